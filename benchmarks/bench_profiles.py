"""Capture speed per profile (CPU): the exact kernel against the engine profiles, which sort.

    python benchmarks/bench_profiles.py [--reps 7] [--shapes 64x49152,64x151936]

Medians in ms (profiles run round-robin per repetition), top_k 50 + top_p 0.9 on LLM-like logits,
and each profile's time as a multiple of exact's.
"""
import argparse
import os
import statistics
import sys
import time

import torch

import mask_replay
from mask_replay.sampler.profiles import PROFILES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_capture import llm_logits  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="64x49152,64x151936")
    args = ap.parse_args()
    kw = dict(top_k=50, top_p=0.9)
    print(f"torch threads: {torch.get_num_threads()}; params {kw}")
    for shape in args.shapes.split(","):
        n, v = (int(s) for s in shape.split("x"))
        z = llm_logits(n, v, torch.float32)
        times = {p: [] for p in PROFILES}
        for p in PROFILES:  # warm-up
            mask_replay.capture(z, profile=p, **kw)
        for _ in range(args.reps):
            for p in PROFILES:
                t0 = time.perf_counter()
                mask_replay.capture(z, profile=p, **kw)
                times[p].append(time.perf_counter() - t0)
        med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
        cells = "  ".join(f"{p} {med[p]:8.1f} ms ({med[p] / med['exact']:5.1f}x)" for p in PROFILES)
        print(f"[{n}, {v}]  {cells}")


if __name__ == "__main__":
    main()
