"""The CPU capture kernel's 16-lane (AVX-512) top-p path against its baseline path and the reference.

The AVX-512 path (csrc/cpu/capture_cpu_top_p.cpp) is chosen at run time; MASK_REPLAY_NO_AVX512=1 turns it
off for the next call. Both paths must return the same supports bit for bit, whatever the row looks like:
the sampled guess only places its levels. Rows are built to hit each of its branches: the guess's window,
a missed guess (one or two more passes), peaked rows (the few-entries list), wide brackets (narrowed in
place), ties, -inf entries, min-p floors, deferred wide supports written by the output pass.
"""
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mask_replay
from tests.helpers import HAS_AVX512, reference_support

ops = torch.ops.mask_replay


needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: only the baseline path runs")


def _op(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logz=True):
    n = x.shape[0]

    def per_row(value, dtype):
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.full((n,), value, dtype=dtype)

    return ops.capture(x, per_row(temperature, torch.float32), per_row(top_k, torch.long),
                       per_row(top_p, torch.float64), per_row(min_p, torch.float64), logz)


def both_paths(x, **kw):
    """(ids, offsets, logz) from the AVX-512 path and from the baseline path."""
    old = os.environ.get("MASK_REPLAY_NO_AVX512")
    try:
        os.environ["MASK_REPLAY_NO_AVX512"] = "0"
        fast = _op(x, **kw)
        os.environ["MASK_REPLAY_NO_AVX512"] = "1"
        base = _op(x, **kw)
    finally:
        if old is None:
            os.environ.pop("MASK_REPLAY_NO_AVX512", None)
        else:
            os.environ["MASK_REPLAY_NO_AVX512"] = old
    return fast, base


def assert_same_paths(x, **kw):
    (ids, off, logz), (ids0, off0, logz0) = both_paths(x, **kw)
    assert torch.equal(off, off0), f"row lengths differ: {(off.diff() - off0.diff()).nonzero().flatten().tolist()}"
    assert torch.equal(ids, ids0), "the supports differ"
    assert torch.equal(logz, logz0), "logz differs"
    return ids, off


def flat(n, v, std, seed=0, dtype=torch.float32):
    return (torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)


def peaked(n, v, heads, seed=0, dtype=torch.float32, spread=0.6):
    """A Gaussian tail under `heads` strong candidates spaced `spread` apart (LM-head-like rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 2.0
    top = 18.0 - torch.arange(heads).float() * spread + torch.randn(n, heads, generator=g) * 0.3
    x.scatter_(1, torch.randint(0, v, (n, heads), generator=g), top)
    return x.to(dtype)


# ---- row shapes that steer the level search ------------------------------------------------------------
# One (dtype, std) per dtype in the fast suite (about 2.5 s each on the 2-core machine: the fp64 sort
# reference over 3 x 70001); the other nine are slow. Random rows of every dtype and spread stay fast
# in test_random_wide_rows_same_on_both_paths and test_capture_isa_differential.py.
FAST_FLAT = {(torch.float32, 1.0), (torch.bfloat16, 4.0), (torch.float16, 0.3)}


@needs_avx512
@pytest.mark.parametrize("dtype,std", [
    pytest.param(d, s, marks=() if (d, s) in FAST_FLAT else pytest.mark.slow)
    for d in (torch.float32, torch.bfloat16, torch.float16) for s in (0.3, 1.0, 2.0, 4.0)])
def test_flat_rows_same_on_both_paths_and_match_reference(dtype, std):
    x = flat(3, 70001, std, seed=int(std * 10), dtype=dtype)  # 70001: neither 16 nor 256 divides it
    for kw in [{"top_p": 0.95}, {"top_p": 0.5}, {"top_p": 0.999, "temperature": 0.7}, {"top_p": 0.9, "min_p": 0.01}]:
        assert_same_paths(x, **kw)
    mask = mask_replay.capture(x, top_p=0.95)
    strict, loose = reference_support(x, top_p=0.95)
    dense = mask.to_dense(x.shape[1])
    assert bool((strict <= dense).all()) and bool((dense <= loose).all())


@needs_avx512
@pytest.mark.parametrize("heads", [1, 3, 12, 40, 200])
def test_peaked_rows_whose_top_tokens_fall_outside_the_hot_blocks(heads):
    # More strong candidates than hot blocks (8): the estimate samples the rest, so the guess often
    # misses and the search needs its outer levels or another pass.
    x = peaked(6, 50000, heads, seed=heads)
    for kw in [{"top_p": 0.95}, {"top_p": 0.7}, {"top_p": 0.999}, {"top_p": 0.95, "temperature": 0.5},
               {"top_p": 0.99, "min_p": 0.001}]:
        assert_same_paths(x, **kw)


@needs_avx512
@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_peaked_rows_over_a_dense_cluster(share):
    # A few strong candidates hold `share` of the mass, thousands of entries 2-3 nats lower the rest:
    # the row counts as peaked, but top-p 0.95 ends inside the cluster, whose entries are too many
    # for the peaked path's list (or sit below its cut): the level search takes over.
    v, heads, cluster = 60000, 8, 6000
    g = torch.Generator().manual_seed(int(share * 10))
    x = torch.randn(2, v, generator=g) - 20.0
    x[:, :heads] = 10.0
    x[:, 1000:1000 + cluster] = 10.0 - 2.5 + torch.randn(2, cluster, generator=g) * 0.1
    x[:, :heads] += math.log(share / (1 - share) * cluster * math.exp(-2.5) / heads)
    x = x[:, torch.randperm(v, generator=g)]
    for p in (0.5, 0.9, 0.95, 0.999):
        assert_same_paths(x, top_p=p)


@needs_avx512
def test_threshold_far_below_the_guess_and_far_above():
    g = torch.Generator().manual_seed(3)
    v = 1 << 17
    # A single block holds most of the mass: the sample sees none of it, the hot blocks all of it.
    one_block = torch.randn(2, v, generator=g) * 0.5 - 10.0
    one_block[:, 512:768] = 5.0 + torch.randn(2, 256, generator=g) * 0.01
    # Mass in a far, dense tail (17 nats below the max) and a lone maximum.
    far_tail = torch.full((2, v), -17.0) + torch.randn(2, v, generator=g) * 0.3
    far_tail[:, 0] = 0.0
    # Two clusters of equal mass 6 nats apart: top-p 0.5 puts the threshold between them.
    two = torch.cat([torch.randn(2, v // 2, generator=g) * 0.2, torch.randn(2, v // 2, generator=g) * 0.2 - 6.0], 1)
    two[:, v // 2:] += math.log(400.0) + 6.0
    for x in (one_block, far_tail, two):
        for p in (0.05, 0.5, 0.9, 0.99, 0.99999):
            assert_same_paths(x, top_p=p)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_and_neg_inf(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.round(torch.randn(4, 40000, generator=g) * 4) / 4  # 25-odd distinct values
    x[torch.rand(4, 40000, generator=g) < 0.3] = float("-inf")
    x[1] = 0.0  # one value only: every level search collapses
    x[2, :39999] = float("-inf")  # a single finite entry
    for p in (0.1, 0.5, 0.95, 0.999):
        assert_same_paths(x.to(dtype), top_p=p)
        assert_same_paths(x.to(dtype), top_p=p, min_p=0.2)


@needs_avx512
def test_huge_logits_where_one_bin_is_below_an_ulp():
    # x = z / T around 1e6: 1/32 of a nat is below the float spacing, so levels collapse onto each other.
    x = flat(2, 20000, 1.0, seed=1) * 3.0 + 1000.0
    for t in (1e-3, 1e-4):
        assert_same_paths(x, top_p=0.9, temperature=t)


@needs_avx512
@pytest.mark.parametrize("v", [1, 2, 15, 16, 17, 255, 256, 257, 4095, 4097, 8193])
def test_short_rows_and_ragged_tails(v):
    for seed in range(3):
        for std in (0.1, 3.0):
            assert_same_paths(flat(5, v, std, seed=seed), top_p=0.9)
            assert_same_paths(peaked(5, max(v, 8), 3, seed=seed)[:, :v], top_p=0.8, min_p=0.05)


# ---- deferred rows and the output pass ------------------------------------------------------------------
@needs_avx512
def test_deferred_and_listed_rows_interleave_in_one_batch():
    # Flat rows (wide supports: written by the output pass) between peaked ones (listed), per-row
    # parameters, 1 and 2 threads, and capture_fixed (never defers) agreeing with capture.
    rows = [flat(1, 30000, 1.0, seed=s) if s % 2 else peaked(1, 30000, 5, seed=s) for s in range(9)]
    x = torch.cat(rows).to(torch.bfloat16)
    t = torch.tensor([1.0, 0.8, 1.2, 1.0, 0.5, 1.0, 2.0, 1.0, 0.9])
    p = torch.tensor([0.95, 0.9, 0.999, 0.5, 0.95, 0.3, 0.99, 0.95, 0.9], dtype=torch.float64)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ids, off = assert_same_paths(x, temperature=t, top_p=p)
            lengths = off.diff()
            assert (lengths > 30000 // 4).any() and (lengths < 100).any()  # both kinds of rows are present
            width = int(lengths.max())
            fixed, counts, overflow = mask_replay.capture_fixed(x, width, temperature=t, top_p=p)
            assert counts.tolist() == lengths.tolist() and not overflow.any()
            for r in range(x.shape[0]):
                assert torch.equal(fixed[r, : lengths[r]], ids[off[r]: off[r + 1]])
    finally:
        torch.set_num_threads(old)


# ---- random rows -----------------------------------------------------------------------------------------
@st.composite
def wide_case(draw):
    v = draw(st.integers(1, 40000))
    n = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["flat", "peaked", "ties", "mixed"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    if kind == "flat":
        x = flat(n, v, draw(st.sampled_from([0.05, 0.5, 1.0, 2.0, 5.0])), seed=seed)
    elif kind == "peaked":
        x = peaked(n, max(v, 1), draw(st.integers(1, 64)), seed=seed, spread=draw(st.sampled_from([0.05, 0.6, 3.0])))
    elif kind == "ties":
        x = torch.round(flat(n, v, 2.0, seed=seed) * 2) / 2
    else:  # strong candidates over a dense cluster a few nats below them, each with a share of the mass
        x = peaked(n, v, draw(st.integers(1, 16)), seed=seed)
        density = draw(st.sampled_from([0.01, 0.1]))
        cluster = torch.rand(n, v, generator=torch.Generator().manual_seed(seed + 1)) < density
        x[cluster] = 18.0 - draw(st.sampled_from([1.0, 4.0, 9.0])) + x[cluster] * 0.05
    kw = {"top_p": draw(st.sampled_from([0.01, 0.3, 0.8, 0.9, 0.95, 0.99, 0.9999])),
          "temperature": draw(st.sampled_from([1.0, 0.6, 1.5])),
          "min_p": draw(st.sampled_from([0.0, 0.0, 1e-4, 0.05]))}
    return x.to(dtype), kw


@needs_avx512
@settings(max_examples=60, deadline=None)
@given(wide_case())
def test_random_wide_rows_same_on_both_paths(case):
    x, kw = case
    assert_same_paths(x, **kw)


def test_turning_the_vector_path_off_still_matches_the_reference(monkeypatch):
    # The baseline path is what CPUs without AVX-512 run: it must stay exact on its own.
    monkeypatch.setenv("MASK_REPLAY_NO_AVX512", "1")
    for x in (flat(2, 20000, 1.0, seed=2), peaked(2, 20000, 6, seed=2)):
        mask = mask_replay.capture(x, top_p=0.95)
        strict, loose = reference_support(x, top_p=0.95)
        dense = mask.to_dense(x.shape[1])
        assert bool((strict <= dense).all()) and bool((dense <= loose).all())
