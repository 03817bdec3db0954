"""The sparse-gradient LM head against the dense path, forward + backward, in one run.

    python benchmarks/bench_sparse_grad.py [--device cpu|cuda] [--reps 7] [--dense-reps 2]

For each size (N, d, V) with mean |K| = 8 (the support-size mix of bench_replay.py):
- dense:  logits = hidden @ weight.T, log_softmax, gather the sampled token, backward to hidden
          and weight (the trainer's path without replay; it writes the dense [V, d] gradient);
- op:     replay_logprobs_from_hidden (the compiled op; dense [V, d] weight gradient), backward;
- sparse: replay_logprobs_from_hidden(sparse_grad=True), backward; weight.grad starts as None
          and ends as the sparse COO gradient;
- sparse+acc: the same, accumulated into an existing dense weight.grad (in place).
fp32 throughout. Times are medians: --reps runs after one warm-up for the sparse paths and the
op; the dense path is slow on a CPU (about 30 s per run at V = 151936), so it gets --dense-reps
runs and no warm-up. The ratios are dense time over each path's time, measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = [(1024, 1024, 151936), (256, 512, 65536)]


def make_inputs(n, d, v, device, seed=0):
    from bench_replay import support_sizes

    import mask_replay as mr

    rng = random.Random(seed + 1)
    rows = [sorted(rng.sample(range(v), k)) for k in support_sizes(n, seed)]
    sampled = torch.tensor([r[rng.randrange(len(r))] for r in rows], dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g) / d ** 0.5).to(device)
    weight = torch.randn(v, d, generator=g).to(device)
    return hidden, weight, mr.SamplingMask.from_lists(rows).to(device), sampled


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps, warmup, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paths(hidden, weight, mask, sampled):
    import mask_replay as mr

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    def dense():
        h.grad = w.grad = None
        logp = torch.log_softmax(h @ w.T, dim=1).gather(1, sampled[:, None])
        logp.sum().backward()

    def op():
        h.grad = w.grad = None
        mr.replay_logprobs_from_hidden(h, w, mask, sampled).sum().backward()

    def sparse():
        h.grad = w.grad = None
        mr.replay_logprobs_from_hidden(h, w, mask, sampled, sparse_grad=True).sum().backward()
        assert w.grad.is_sparse

    acc = torch.zeros_like(weight)

    def sparse_acc():
        h.grad = None
        w.grad = acc  # the trainer's accumulated dense gradient
        mr.replay_logprobs_from_hidden(h, w, mask, sampled, sparse_grad=True).sum().backward()
        assert w.grad.data_ptr() == acc.data_ptr()

    return {"dense": dense, "op": op, "sparse": sparse, "sparse+acc": sparse_acc}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dense-reps", type=int, default=2)
    ap.add_argument("--sizes", default="all", help="'all' or 'small' (only N=256, d=512, V=65536)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = SIZES if args.sizes == "all" else SIZES[1:]
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, fp32, "
          f"medians: {args.reps} reps after 1 warm-up (dense: {args.dense_reps} reps, no warm-up), ms")
    print(f"{'N':>6} {'d':>6} {'V':>7} {'mean|K|':>8} {'dense':>10} {'op':>9} {'sparse':>9} {'sparse+acc':>11}"
          f" {'x op':>7} {'x sparse':>9} {'x sp+acc':>9}")
    for n, d, v in sizes:
        hidden, weight, mask, sampled = make_inputs(n, d, v, device)
        fns = paths(hidden, weight, mask, sampled)
        t = {name: timed(fn, args.reps, 1, device) for name, fn in fns.items() if name != "dense"}
        t["dense"] = timed(fns["dense"], args.dense_reps, 0, device)
        ms = {k: 1e3 * s for k, s in t.items()}
        print(f"{n:>6} {d:>6} {v:>7} {mask.nnz / n:>8.2f} {ms['dense']:>10.1f} {ms['op']:>9.2f} {ms['sparse']:>9.2f}"
              f" {ms['sparse+acc']:>11.2f} {t['dense'] / t['op']:>7.0f} {t['dense'] / t['sparse']:>9.0f}"
              f" {t['dense'] / t['sparse+acc']:>9.0f}", flush=True)
        del fns, hidden, weight


if __name__ == "__main__":
    main()
