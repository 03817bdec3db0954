"""Hostile-input fuzz loop over every mask_replay op, called at the op boundary (torch.ops).

Every call must either return or raise a Python exception; anything else (a crash, or under the
AddressSanitizer build a memory error report) ends the process with a non-zero status. Used by
`make asan` (the ASAN copy of the CPU extension, loaded through MASK_REPLAY_EXTENSION) and, for a
few seconds with the normal build, by tests/ops/test_op_boundary.py.

Usage: python tests/ops/fuzz_ops.py [--seconds S] [--seed N]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import mask_replay  # noqa: F401  (loads the extension and registers the ops)

ops = torch.ops.mask_replay

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
WRONG = (torch.int32, torch.int64, torch.bool, torch.int8)
# Mostly valid values, so that most calls get past the checks into the kernels' loops.
TEMPERATURES = (1.0, 0.7, 2.0, 1.0, 0.7, 2.0, 1.0, 0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e30)


def pick(rng: random.Random, good, bad, p_bad=0.1):
    return rng.choice(bad) if rng.random() < p_bad else rng.choice(good)


def layout(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """The same values in an odd memory layout: column-major, strided, or broadcast rows."""
    if t.dim() != 2:
        return t
    k = rng.randrange(5)
    if k == 1:
        return t.t().contiguous().t()  # column-major
    if k == 2:
        wide = torch.empty(t.shape[0], 2 * t.shape[1] + 1, dtype=t.dtype)
        wide[:, 1::2] = t
        return wide[:, 1::2]  # stride 2 along the vocabulary
    if k == 3 and t.shape[0] > 0:
        return t[:1].expand(t.shape[0], t.shape[1])  # stride 0 along the rows
    return t


def logits_like(rng: random.Random, n: int, v: int) -> torch.Tensor:
    if rng.random() < 0.04:
        shape = rng.choice([(v,), (n, v, 2), ()])
        return torch.randn(shape)
    z = torch.randn(n, v, dtype=torch.float64) * rng.choice([0.1, 1.0, 30.0])
    if rng.random() < 0.2 and z.numel():
        flat = z.view(-1)
        for _ in range(rng.randrange(1, 4)):
            flat[rng.randrange(flat.numel())] = rng.choice([float("nan"), float("inf"), float("-inf"), 1e38])
    return layout(rng, z.to(pick(rng, FLOATS, WRONG, 0.05)))


def csr(rng: random.Random, n: int, v: int):
    """A CSR mask of n rows, valid or broken in one of the ways a caller can break it."""
    rows = [sorted(rng.sample(range(max(v, 1)), rng.randrange(0, min(max(v, 1), 6) + 1))) for _ in range(n)]
    ids = [t for r in rows for t in r]
    off = [0]
    for r in rows:
        off.append(off[-1] + len(r))
    defect = rng.randrange(20)  # 7 kinds of defect, 35% of the masks
    if defect == 0 and ids:
        ids[rng.randrange(len(ids))] = rng.choice([-1, v, v + 7, 2**31 - 1, -(2**31)])
    elif defect == 1 and len(ids) > 1:
        rng.shuffle(ids)
    elif defect == 2:
        off[rng.randrange(len(off))] = rng.choice([-1, -(2**40), len(ids) + 1, 2**62])
    elif defect == 3:
        off = [x + rng.choice([1, -1]) for x in off]  # offsets[0] != 0
    elif defect == 4:
        ids += [rng.randrange(max(v, 1))] * rng.randrange(1, 4)  # trailing unused ids
    elif defect == 5 and len(off) > 2:
        off[1], off[2] = off[2], off[1]  # decreasing
    elif defect == 6:
        off = off[:-1] if rng.random() < 0.5 else off + [off[-1]]  # wrong number of rows
    t_ids = torch.tensor(ids, dtype=torch.int32) if rng.random() > 0.05 else torch.tensor(ids, dtype=torch.int64)
    t_off = torch.tensor(off, dtype=torch.int64) if rng.random() > 0.05 else torch.tensor(off, dtype=torch.int32)
    if rng.random() < 0.03:
        t_off = t_off[:1].reshape(())  # 0-dim
    if rng.random() < 0.05 and t_ids.numel() > 1:
        t_ids = t_ids[::2]  # non-contiguous
    return t_ids, t_off


def per_row(rng: random.Random, n: int, values, dtype, wrong=WRONG) -> torch.Tensor:
    m = n if rng.random() > 0.05 else rng.choice([0, n + 1, max(n - 1, 0)])
    t = torch.tensor([rng.choice(values) for _ in range(m)], dtype=torch.float64)
    want = dtype if rng.random() > 0.05 else rng.choice(wrong + FLOATS)
    try:
        return t.to(want)
    except RuntimeError:
        return t.to(dtype)


def sampled_for(rng: random.Random, n: int, v: int) -> torch.Tensor:
    vals = [rng.randrange(max(v, 1)) for _ in range(n)]
    if rng.random() < 0.15 and n:
        vals[rng.randrange(n)] = rng.choice([-1, v, v + 1, 10**9, -(2**62), 2**62])
    t = torch.tensor(vals, dtype=torch.int64)
    if rng.random() < 0.05:
        t = t.to(rng.choice([torch.int32, torch.bool, torch.float32]))
    if rng.random() < 0.04:
        t = t[: max(n - 1, 0)]
    return t


def one_call(rng: random.Random) -> str:
    n, v = rng.choice([0, 1, 2, 3, 5, 8]), rng.choice([0, 1, 2, 7, 64, 300])
    z = logits_like(rng, n, v)
    temp = per_row(rng, n, TEMPERATURES, torch.float32)
    op = rng.choice(["capture", "capture_fixed", "replay_fwd", "replay_bwd", "full_fwd", "full_bwd", "kept_mass",
                     "hidden_fwd", "hidden_bwd"])
    if op in ("capture", "capture_fixed"):
        k = per_row(rng, n, (0, 1, 3, -5, v, v + 5, 2**62), torch.int64)
        p = per_row(rng, n, (1.0, 0.9, 0.5, 1e-9, 0.0, -0.5, 1.5, float("nan")), torch.float64)
        mp = per_row(rng, n, (0.0, 0.1, 0.9, 1.0, -0.1, 1.5, float("nan")), torch.float64)
        if op == "capture":
            ops.capture(z, temp, k, p, mp, rng.random() < 0.5)
        else:
            ops.capture_fixed(z, temp, k, p, mp, rng.choice([-1, 0, 1, 4, 1000]))
        return op
    y = sampled_for(rng, n, v)
    ids, off = csr(rng, n, v)
    out_dt = torch.float64 if z.dtype == torch.float64 else torch.float32
    grad = torch.randn(n, dtype=out_dt) if rng.random() > 0.05 else torch.randn(n + 1)
    lse = (torch.randn(n, dtype=out_dt) + 3) if rng.random() > 0.05 else torch.randn(max(n - 1, 0))
    status = torch.tensor([rng.choice([0, 0, 1, 2, -1, 5]) for _ in range(n)], dtype=torch.int8)
    if op == "replay_fwd":
        ops.replay_fwd(z, ids, off, y, temp, rng.random() < 0.5)
    elif op == "replay_bwd":
        ops.replay_bwd(grad, z, ids, off, y, temp, lse, status)
    elif op == "full_fwd":
        ops.full_fwd(z, y, temp)
    elif op == "full_bwd":
        ops.full_bwd(grad, z, y, temp, lse)
    elif op == "kept_mass":
        ops.kept_mass(z, ids, off, temp)
    else:
        d = rng.choice([0, 1, 3, 16])
        dt = z.dtype if z.dtype in FLOATS else torch.float32
        h = layout(rng, torch.randn(n, d, dtype=dt))
        w = layout(rng, torch.randn(v if rng.random() > 0.05 else v + 1, d, dtype=dt))
        b = torch.randn(v, dtype=dt) if rng.random() < 0.5 else torch.empty(rng.choice([0, 0, 3]), dtype=dt)
        if op == "hidden_fwd":
            ops.hidden_fwd(h, w, b, ids, off, y, temp, rng.random() < 0.5)
        else:
            ops.hidden_bwd(grad, h, w, b, ids, off, y, temp, lse, status)
    return op


def fuzz(seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    stats = {"calls": 0, "returned": 0, "raised": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stats["calls"] += 1
        try:
            one_call(rng)
            stats["returned"] += 1
        except Exception:  # any Python exception is a clean refusal; only crashes fail
            stats["raised"] += 1
    return stats  # a crash replays with the same --seed (the call stream depends on it alone)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    s = fuzz(args.seconds, args.seed)
    print(f"fuzz_ops: {s['calls']} calls in {args.seconds:g} s (seed {args.seed}): {s['returned']} returned, "
          f"{s['raised']} raised a Python exception, no crash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
