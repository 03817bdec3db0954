"""The sparse LM head's weight gradient with one token in every row's support, against spread tokens.

    python benchmarks/bench_hot_token.py [--device cpu|cuda] [--sizes 4096x1024,4096x4096] [--vocab 8192]
                                         [--support 8] [--reps 5] [--threads 0]

The weight gradient sums, for every token j, c_e * h[row_e] over the entries e of j; the kernels
give each token's run of entries to one worker. A token present in every row (punctuation under
top-p is common) makes one run of N entries, which one worker would sum alone. Per size N x d,
with `--support` tokens per row (the sampled one among them), fp32:
- spread: the supports drawn uniformly from the vocabulary;
- hot:    the same, with token 0 in every row's support in place of one drawn token;
- dense:  the dense weight-gradient GEMM G^T H ([V, N] x [N, d], what the gradient costs through
          dense logits), the baseline both are compared with.
The op timed is hidden_bwd (the backward of replay_logprobs_from_hidden: per-row coefficients,
grad_hidden, then the weight gradient), with lse/status from one hidden_fwd. Medians of --reps
runs after one warm-up; ratios are measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from timing import time_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's mask_replay
import mask_replay as mr  # noqa: E402
from mask_replay._ops import ops  # noqa: E402


def supports(n, v, k, hot, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randperm(v - 1, generator=g)[:k] + 1  # tokens 1..v-1: token 0 is the hot one
        if hot:
            ids[0] = 0
        rows.append(sorted(ids.tolist()))
    sampled = torch.tensor([row[-1] for row in rows], dtype=torch.int64)
    return mr.SamplingMask.from_lists(rows), sampled


def backward_call(hidden, weight, mask, sampled, device):
    n = hidden.shape[0]
    ids, off, y = mask.token_ids.to(device), mask.offsets.to(device), sampled.to(device)
    t = torch.ones(n, device=device)
    bias = torch.empty(0, device=device)
    _, lse, status = ops.hidden_fwd(hidden, weight, bias, ids, off, y, t, False)
    grad = torch.ones(n, device=device)
    return lambda: ops.hidden_bwd(grad, hidden, weight, bias, ids, off, y, t, lse, status)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="4096x1024,4096x4096", help="comma-separated NxD")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--support", type=int, default=8, help="tokens per row")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    v, k = args.vocab, args.support
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, fp32, V = {v}, "
          f"|K| = {k}, medians of {args.reps} after 1 warm-up, ms")
    print(f"{'N':>6} {'d':>6} {'spread':>9} {'hot':>9} {'dense':>9} {'hot/spread':>11} {'dense/spread':>13}"
          f" {'dense/hot':>10}")
    for size in args.sizes.split(","):
        n, d = (int(x) for x in size.lower().split("x"))
        g = torch.Generator().manual_seed(n + d)
        hidden = (torch.randn(n, d, generator=g) / d ** 0.5).to(device)
        weight = torch.randn(v, d, generator=g).to(device)
        t = {}
        for name, hot in (("spread", False), ("hot", True)):
            mask, sampled = supports(n, v, k, hot, seed=n)
            call = backward_call(hidden, weight, mask, sampled, device)
            t[name] = time_us(call, args.reps, torch.device(device)) / 1e6
        dense_coef = torch.randn(n, v, generator=g).to(device)
        t["dense"] = time_us(lambda: dense_coef.T @ hidden, args.reps, torch.device(device)) / 1e6
        ms = {name: 1e3 * s for name, s in t.items()}
        print(f"{n:>6} {d:>6} {ms['spread']:>9.2f} {ms['hot']:>9.2f} {ms['dense']:>9.1f}"
              f" {t['hot'] / t['spread']:>11.2f} {t['dense'] / t['spread']:>13.1f} {t['dense'] / t['hot']:>10.1f}",
              flush=True)


if __name__ == "__main__":
    main()
