"""Numerics promised in docs/semantics.md (issue 9 §4): one logZ for capture's kept mass,
kept_mass and full_logprobs; kept mass never above 1; results independent of memory layout."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mask_replay
from mask_replay import SamplingMask


def flat_tail_row(v: int) -> torch.Tensor:
    """The issue's row: one token at 0, every other at -28.5 (each below 2^-40 of the max)."""
    z = torch.full((1, v), -28.5)
    z[0, 0] = 0.0
    return z


def exact_logz(v: int) -> float:
    return math.log1p((v - 1) * math.exp(-28.5))


@pytest.mark.parametrize("v", [151936, 2 ** 23 - 1])
def test_kept_mass_of_the_single_token_support_to_1e6(v):
    z = flat_tail_row(v)
    want = math.exp(-exact_logz(v))  # 1 / (1 + (V-1) e^-28.5): visibly below 1 at V = 2^23-1
    m = mask_replay.capture(z, top_k=1, sampled=torch.tensor([0]))
    assert m.to_lists() == [[0]]
    got = float(m.kept_mass[0])
    assert got <= 1.0
    assert abs(got - want) / want < 1e-6, (got, want)
    direct = float(mask_replay.kept_mass(z, m)[0])
    assert abs(direct - want) / want < 1e-6
    assert got == direct  # capture takes its kept mass from the one definition
    full = float(mask_replay.full_logprobs(z, torch.tensor([0]))[0])
    assert abs(full - (-exact_logz(v))) < 1e-6 * max(1.0, exact_logz(v))


@pytest.mark.parametrize("v", [151936, 2 ** 23 - 1])
def test_kept_mass_of_the_whole_vocabulary_is_at_most_1(v):
    z = flat_tail_row(v)
    m = SamplingMask(torch.arange(v, dtype=torch.int32), torch.tensor([0, v]))
    kept = float(mask_replay.kept_mass(z, m)[0])
    assert kept <= 1.0 and kept > 1.0 - 1e-6
    cap = mask_replay.capture(z, top_p=1.0, sampled=torch.tensor([0]))
    assert cap.nnz == v and float(cap.kept_mass[0]) <= 1.0


@settings(max_examples=40, deadline=None)
@given(v=st.integers(1, 600), scale=st.sampled_from([0.01, 1.0, 20.0, 200.0]), seed=st.integers(0, 2 ** 16),
       t=st.sampled_from([0.3, 1.0, 2.5]))
def test_kept_mass_never_above_1(v, scale, seed, t):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, v, generator=g) * scale
    keep_all = SamplingMask(torch.arange(v, dtype=torch.int32).repeat(3), torch.arange(4) * v)
    kept = mask_replay.kept_mass(z, keep_all, t)
    assert bool((kept <= 1.0).all()), kept
    assert bool((kept > 1.0 - 1e-5).all()), kept


def layouts(z: torch.Tensor):
    """The same values row-major, column-major, and strided along the vocabulary."""
    col = z.t().contiguous().t()
    wide = torch.zeros(z.shape[0], 2 * z.shape[1], dtype=z.dtype)
    wide[:, ::2] = z
    return [z.contiguous(), col, wide[:, ::2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("v", [7, 1000, 4099])
def test_full_logprobs_and_kept_mass_are_layout_independent(dtype, v):
    torch.manual_seed(v)
    z = (torch.randn(6, v) * 3).to(dtype)
    y = torch.randint(0, v, (6,))
    m = mask_replay.capture(z.float(), top_p=0.9)
    outs = [(mask_replay.full_logprobs(x, y, 0.8), mask_replay.kept_mass(x, m, 0.8)) for x in layouts(z)]
    assert not outs[1][0].data_ptr() == outs[0][0].data_ptr()
    for lp, kept in outs[1:]:
        assert torch.equal(lp, outs[0][0]), (lp - outs[0][0]).abs().max()
        assert torch.equal(kept, outs[0][1]), (kept - outs[0][1]).abs().max()


def test_layout_independent_gradients():
    torch.manual_seed(1)
    z = torch.randn(4, 513)
    y = torch.randint(0, 513, (4,))
    grads = []
    for x in layouts(z):
        x = x.detach().requires_grad_(True)
        mask_replay.full_logprobs(x, y).sum().backward()
        grads.append(x.grad)
    for gr in grads[1:]:
        assert torch.equal(gr, grads[0])
