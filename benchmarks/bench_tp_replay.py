"""Vocab-parallel replay (torchrun, gloo) against the single-process op, forward + backward.

    python benchmarks/bench_tp_replay.py [--rows 1024] [--ranks 1 2 4] [--runs 7]

N rows, V = 151936, the support sizes of bench_replay.py (mean |K| = 8). The single-process
mask_replay.replay_logprobs on fp32 logits [N, V] runs with 1 thread and with as many threads as
the machine has cores (at most the largest rank count); each vocab-parallel run is `torchrun --nproc-per-node
P` with one thread per
rank, each rank holding its [N, V/P] shard (1 rank: the torch composition itself, no sharding). An iteration
is timed from a barrier to the end of the
backward on every rank, and its time is the slowest rank's; figures are medians of --runs after
one warm-up. Each configuration runs in its own process(es).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_replay import V, make_mask  # noqa: E402


def fwd_bwd(fn, leaf):
    out = fn(leaf)
    out.sum().backward()
    leaf.grad = None


def single(rows, runs, threads):
    import mask_replay

    torch.set_num_threads(threads)
    mask, sampled = make_mask(rows)
    logits = (torch.randn(rows, V) * 3).requires_grad_()
    fn = lambda z: mask_replay.replay_logprobs(z, mask, sampled)  # noqa: E731
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        fwd_bwd(fn, logits)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rows, runs):
    import torch.distributed as dist

    from mask_replay.trainer.vocab_parallel import replay_logprobs_vocab_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mask, sampled = make_mask(rows)  # the same seeded mask on every rank
    size = V // world + (rank < V % world)
    start = rank * (V // world) + min(rank, V % world)
    shard = (torch.randn(rows, size, generator=torch.Generator().manual_seed(rank)) * 3).requires_grad_()
    fn = lambda z: replay_logprobs_vocab_parallel(z, mask, sampled, vocab_start=start)  # noqa: E731
    times = []
    for i in range(runs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fwd_bwd(fn, shard)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(t))
    if rank == 0:
        print(json.dumps({"ranks": world, "median_s": statistics.median(times)}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--single-threads", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.rows, a.runs)
    if a.single_threads:
        return print(json.dumps({"median_s": single(a.rows, a.runs, a.single_threads)}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    me = os.path.abspath(__file__)
    results = {}
    for threads in sorted({1, min(max(a.ranks), os.cpu_count() or 1)}):
        out = subprocess.run([sys.executable, me, "--rows", str(a.rows), "--runs", str(a.runs),
                              "--single-threads", str(threads)], check=True, capture_output=True, text=True)
        results[f"single process, {threads} thread(s)"] = json.loads(out.stdout.strip().splitlines()[-1])["median_s"]
    for p in a.ranks:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
                              me, "--worker", "--rows", str(a.rows), "--runs", str(a.runs)],
                             check=True, capture_output=True, text=True, env=env)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
        results[f"vocab-parallel, {p} ranks x 1 thread"] = json.loads(line)["median_s"]
    base = results["single process, 1 thread(s)"]
    print(f"N={a.rows} V={V} mean |K|=8, fp32, forward+backward, median of {a.runs} "
          f"({os.cpu_count()} CPUs, torch {torch.__version__})")
    print(f"{'configuration':40s} {'ms':>9s} {'vs 1 thread':>12s}")
    for name, t in results.items():
        print(f"{name:40s} {t * 1e3:9.2f} {base / t:11.2f}x")


if __name__ == "__main__":
    main()
