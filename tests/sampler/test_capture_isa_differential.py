"""Differential fuzz of capture's CPU paths: the AVX-512 loops, the build's own loops (AVX2 where the
build machine had it) and the `exact` definition (docs/semantics.md, as tests/helpers.reference_support
writes it in fp64 with sorting, sharing no code with the kernel).

Both paths must give the same supports and logz bit for bit, and each must lie between the reference's
strict and loose supports. The path is chosen per call by MASK_REPLAY_NO_AVX512 (read by the dispatch on
every call), and build_info's cpu_isa, read from the same switch, confirms which path each leg ran.
Rows: ties, -inf entries, T from 1e-4 to 1e3 and greedy, top-k, top-p and min-p alone and together.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mask_replay
from tests.helpers import HAS_AVX512, reference_support

ops = torch.ops.mask_replay


@st.composite
def row_batch(draw):
    n = draw(st.integers(1, 4))
    v = draw(st.sampled_from([1, 2, 15, 16, 17, 255, 257, 1000, 4097, 12000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.01, 1.0, 4.0, 30.0]))
    x = torch.randn(n, v, generator=g) * scale
    shape = draw(st.sampled_from(["plain", "ties", "peaked", "one_value"]))
    if shape == "ties":  # a few distinct values: every threshold falls on a tie
        x = torch.round(x / scale * 2) / 2
    elif shape == "peaked":
        x[:, torch.randint(0, v, (draw(st.integers(1, 8)),), generator=g)] += 15.0
    elif shape == "one_value":
        x = torch.full((n, v), draw(st.sampled_from([-3.0, 0.0, 7.5])))
    x += draw(st.sampled_from([0.0, 1e4]))  # large offsets: z / T far from 0, spacing above 1/32 of a nat
    neg_inf = draw(st.sampled_from([0.0, 0.3, 0.99]))
    x[torch.rand(n, v, generator=g) < neg_inf] = float("-inf")
    x[:, draw(st.integers(0, v - 1))] = x[:, 0].clamp_min(0.0) + 1.0  # at least one finite entry per row
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # finite in fp16 (-inf stays -inf)
    params = {
        "temperature": draw(st.sampled_from([1.0, 1.0, 0.0, 1e-4, 0.05, 0.7, 1.5, 1e3])),
        "top_k": draw(st.sampled_from([None, None, 1, 2, 5, 50, 100000])),
        "top_p": draw(st.sampled_from([None, None, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999])),
        "min_p": draw(st.sampled_from([None, None, 1e-6, 0.01, 0.3, 1.0])),
    }
    return x.to(dtype), params


def _capture(x, params, no_avx512):
    old = os.environ.get("MASK_REPLAY_NO_AVX512")
    os.environ["MASK_REPLAY_NO_AVX512"] = no_avx512
    try:
        isa = mask_replay.build_info()["cpu_isa"]
        n = x.shape[0]
        args = [torch.full((n,), params["temperature"], dtype=torch.float32),
                torch.full((n,), params["top_k"] or 0, dtype=torch.long),
                torch.full((n,), 1.0 if params["top_p"] is None else params["top_p"], dtype=torch.float64),
                torch.full((n,), params["min_p"] or 0.0, dtype=torch.float64)]
        return isa, ops.capture(x, *args, True)
    finally:
        if old is None:
            os.environ.pop("MASK_REPLAY_NO_AVX512")
        else:
            os.environ["MASK_REPLAY_NO_AVX512"] = old


def _check_against_exact(x, params, ids, off):
    strict, loose = reference_support(x, **params)
    n, v = x.shape
    dense = torch.zeros(n, v, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(n), off.diff())
    dense[rows, ids.long()] = True
    assert int(off[-1]) == int(dense.sum()), "a row lists an id twice"
    missing, extra = (strict & ~dense).any(1), (dense & ~loose).any(1)
    assert not missing.any(), f"rows miss ids of the exact support: {missing.nonzero().flatten().tolist()}"
    assert not extra.any(), f"rows keep ids outside the exact support: {extra.nonzero().flatten().tolist()}"


# The suite-wide profile (tests/conftest.py: 60 derandomized examples in CI) sets how many cases run.
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(row_batch())
def test_the_build_path_matches_the_exact_definition(case):
    x, params = case
    isa, (ids, off, _) = _capture(x, params, "1")
    assert isa == mask_replay.build_info()["cpu_build_isa"]
    _check_against_exact(x, params, ids, off)


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 (avx512f/bw/dq/vl): its leg of the differential "
                                            "test cannot run here; the build path is still checked")
@FUZZ
@given(row_batch())
def test_the_avx512_path_matches_the_build_path_bit_for_bit_and_the_exact_definition(case):
    x, params = case
    isa, (ids, off, logz) = _capture(x, params, "0")
    isa0, (ids0, off0, logz0) = _capture(x, params, "1")
    assert (isa, isa0) == ("avx512", mask_replay.build_info()["cpu_build_isa"])
    assert torch.equal(off, off0), f"row lengths differ: {off.diff().tolist()} vs {off0.diff().tolist()}"
    assert torch.equal(ids, ids0), "the supports differ"
    assert torch.equal(logz, logz0) or bool((logz.isnan() == logz0.isnan()).all()
                                            and torch.equal(logz.nan_to_num(), logz0.nan_to_num())), "logz differs"
    _check_against_exact(x, params, ids, off)
