"""replay_support_logprobs, forward + backward, against the dense path, in one run.

    python benchmarks/bench_support_logprobs.py [--sizes 4096x151936,1024x151936] [--d 1024]
        [--reps 5] [--dense-reps 2] [--hidden-dense-reps 1] [--threads 0] [--no-hidden]

Per size (N rows, vocabulary V, mean |S| = 8: the support-size mix of bench_replay.py), fp32:
- logits, dense:  (logits / T).masked_fill(~S, -inf), log_softmax, gather the nnz entries, backward;
- logits, ours:   mask_replay.replay_support_logprobs(logits, mask), backward;
- hidden, dense:  logits = hidden @ weight.T (d = --d), then the dense path above, backward to
                  hidden and weight;
- hidden, ours:   replay_support_logprobs_from_hidden(..., sparse_grad=True), backward (weight.grad a
                  sparse COO tensor over the support's rows).
The backward of each path sums the [nnz] output weighted by fixed random numbers. Times are medians
of --reps runs after one warm-up (the dense paths: their own rep counts, no warm-up: seconds per run
on a CPU). Ratios are dense time over ours, measured in the same run.

Peak memory: each path runs once more in a fresh subprocess, which resets its peak resident set
(/proc/self/clear_refs, 5) after building its inputs and reads VmHWM after one forward + backward;
the table gives that increase. An [N, V] fp32 tensor is N * V * 4 bytes (2.5 GB at 4096 x 151936):
the hidden path's increase must stay far below it (checked: the run fails otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_replay import support_sizes  # noqa: E402

import mask_replay as mr  # noqa: E402
from mask_replay.trainer.support_logprobs import replay_support_logprobs_from_hidden  # noqa: E402

TEMP = 0.8


def make_inputs(n, v, d, seed=0):
    rng = random.Random(seed + 1)
    rows = [sorted(rng.sample(range(v), k)) for k in support_sizes(n, seed)]
    mask = mr.SamplingMask.from_lists(rows)
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(mask.nnz, generator=g) + 0.5
    return mask, weights, g


def paths(n, v, d, which):
    """{name: fn} of the paths in `which` ('logits', 'hidden'), each one forward + backward."""
    mask, weights, g = make_inputs(n, v, d)
    rows, ids = mask.row_ids(), mask.token_ids.long()
    dense_mask = mask.to_dense(v)  # the dense paths' [N, V] bool support, built once outside the timing
    out = {}
    if "logits" in which:
        logits = (torch.randn(n, v, generator=g) * 3).requires_grad_(True)

        def dense_logits():
            logits.grad = None
            x = (logits / TEMP).masked_fill(~dense_mask, float("-inf"))
            lp = torch.log_softmax(x, dim=1)[rows, ids]
            (lp * weights).sum().backward()

        def ours_logits():
            logits.grad = None
            (mr.replay_support_logprobs(logits, mask, temperature=TEMP) * weights).sum().backward()

        out.update({"logits_dense": dense_logits, "logits_ours": ours_logits})
    if "hidden" in which:
        hidden = (torch.randn(n, d, generator=g) / d ** 0.5).requires_grad_(True)
        weight = torch.randn(v, d, generator=g).requires_grad_(True)

        def dense_hidden():
            hidden.grad = weight.grad = None
            x = ((hidden @ weight.T) / TEMP).masked_fill(~dense_mask, float("-inf"))
            lp = torch.log_softmax(x, dim=1)[rows, ids]
            (lp * weights).sum().backward()

        def ours_hidden():
            hidden.grad = weight.grad = None
            lp = replay_support_logprobs_from_hidden(hidden, weight, mask, temperature=TEMP, sparse_grad=True)
            (lp * weights).sum().backward()
            assert weight.grad.is_sparse

        out.update({"hidden_dense": dense_hidden, "hidden_ours": ours_hidden})
    return out, mask


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_peak(n, v, d, name):
    """In this (fresh) process: the increase of the peak resident set over one run of `name`, in KB."""
    fns, _ = paths(n, v, d, ("logits",) if name.startswith("logits") else ("hidden",))
    rss = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    fns[name]()
    return _status_kb("VmHWM") - rss


def peak_in_subprocess(n, v, d, name, threads):
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", name, "--sizes", f"{n}x{v}", "--d", str(d),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_increase_kb"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096x151936,1024x151936", help="comma-separated NxV")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dense-reps", type=int, default=2)
    ap.add_argument("--hidden-dense-reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-hidden", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the memory subprocess
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    if args.measure:
        n, v = sizes[0]
        print(json.dumps({"peak_increase_kb": measure_peak(n, v, args.d, args.measure)}))
        return
    which = ("logits",) if args.no_hidden else ("logits", "hidden")
    print(f"torch {torch.__version__}, cpu, threads {torch.get_num_threads()}, fp32, T = {TEMP}, d = {args.d}; "
          f"medians of {args.reps} reps after 1 warm-up (dense: {args.dense_reps} reps, hidden dense: "
          f"{args.hidden_dense_reps}, no warm-up); ms; peak = increase of the peak RSS over one run, MB")
    for n, v in sizes:
        fns, mask = paths(n, v, args.d, which)
        ms = {}
        for name, fn in fns.items():
            reps = args.reps if name.endswith("ours") else (
                args.dense_reps if name.startswith("logits") else args.hidden_dense_reps)
            ms[name] = 1e3 * timed(fn, reps, 1 if name.endswith("ours") else 0)
        del fns
        nv_mb = n * v * 4 / 2 ** 20
        line = f"N={n} V={v} nnz={mask.nnz} (mean |S| {mask.nnz / n:.2f}); an [N, V] fp32 tensor is {nv_mb:.0f} MB"
        print(line, flush=True)
        for kind in which:
            d, o = ms[f"{kind}_dense"], ms[f"{kind}_ours"]
            text = f"  {kind:<6} dense {d:>10.1f}  ours {o:>9.2f}  x{d / o:>8.1f}"
            if not args.no_memory:
                pd = peak_in_subprocess(n, v, args.d, f"{kind}_dense", args.threads) / 1024
                po = peak_in_subprocess(n, v, args.d, f"{kind}_ours", args.threads) / 1024
                text += f"   peak dense {pd:>8.0f}  ours {po:>8.0f}"
                if kind == "hidden" and nv_mb >= 256 and po >= nv_mb / 4:  # small shapes: allocator noise
                    raise SystemExit(f"hidden path: peak increase {po:.0f} MB is not far below one [N, V] "
                                     f"tensor ({nv_mb:.0f} MB)")
            print(text, flush=True)


if __name__ == "__main__":
    main()
