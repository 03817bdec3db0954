"""Engine adapters against the cost of reading the response at all (CPU).

    python benchmarks/bench_adapters.py [--reps 5] [--completions 1000] [--tokens 200] [--max-support 40]

One synthetic vLLM generate response (completions x tokens generated tokens, mask rows of 1 to
max-support distinct ids out of 151936, unordered as engines send them). Prints medians of:
json.loads of the response text (the baseline every consumer pays), SamplingMask.from_vllm on
the parsed dicts (all checks on), SamplingMask.from_lists on the same rows (the plain
constructor), and to_padded / from_padded of the result; with ratios to json.loads.
"""
import argparse
import json
import statistics
import time

import numpy as np

from mask_replay import SamplingMask


def response(completions, tokens, max_support, seed=0):
    rng = np.random.default_rng(seed)
    choices = []
    for c in range(completions):
        sizes = rng.integers(1, max_support + 1, size=tokens)
        rows = [rng.choice(151936, size=int(k), replace=False).tolist() for k in sizes]
        choices.append({"index": c, "token_ids": [r[0] for r in rows], "sampling_mask": rows,
                        "logprobs": {"content": [{"logprob": -0.1} for _ in rows]}})
    return {"request_id": "bench", "choices": choices}


def median_s(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--completions", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--max-support", type=int, default=40)
    a = ap.parse_args()
    resp = response(a.completions, a.tokens, a.max_support)
    text = json.dumps(resp)
    rows = [r for ch in resp["choices"] for r in ch["sampling_mask"]]
    mask = SamplingMask.from_vllm(resp)
    ids, counts = mask.to_padded()
    print(f"{mask.num_rows} rows, {mask.nnz} ids, width {ids.shape[1]}, JSON {len(text) / 1e6:.1f} MB")
    cases = [
        ("json.loads (baseline)", lambda: json.loads(text)),
        ("SamplingMask.from_vllm", lambda: SamplingMask.from_vllm(resp)),
        ("SamplingMask.from_lists", lambda: SamplingMask.from_lists(rows)),
        ("to_padded", lambda: mask.to_padded()),
        ("from_padded", lambda: SamplingMask.from_padded(ids, counts)),
    ]
    base = None
    for name, fn in cases:
        s = median_s(fn, a.reps)
        base = base or s
        print(f"{name:26s} {s * 1e3:9.1f} ms  {mask.nnz / s / 1e6:6.1f} M ids/s  {s / base:5.2f}x json.loads")


if __name__ == "__main__":
    main()
