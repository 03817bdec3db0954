"""Engine profiles of capture: every minimal row of issue 10 with its support per profile written by
hand, the engines' own test cases, and random rows against independent float64 references."""
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import mask_replay
from mask_replay import OutsideSupportError
from mask_replay.mask import SEMANTICS
from mask_replay.sampler.profiles import PROFILES, engine_support, semantics
from mask_replay.sampler.profiles.mismatch import CAUSES, compare_logprobs, summarise

INF = float("inf")
ENGINES = ("vllm", "sglang", "hf")


def support(z, profile, **params):
    """Token ids of each row's support (lists), via the public API."""
    z = torch.as_tensor(z, dtype=torch.float32)
    z = z.unsqueeze(0) if z.dim() == 1 else z
    mask = mask_replay.capture(z, profile=profile, **params)
    return [mask.token_ids[mask.offsets[r]:mask.offsets[r + 1]].tolist() for r in range(z.shape[0])]


def one_row(z, profile, **params):
    return support(z, profile, **params)[0]


def test_profiles_are_exposed():
    assert PROFILES == ("exact", "vllm", "sglang", "hf")
    assert mask_replay.sampler.profiles.PROFILES is PROFILES


# ---- the minimal rows of issue 10 -----------------------------------------------------------------
def test_tie_group_at_the_top_p_cut():
    # p = exp(z)/726.7: the tail 5..7 holds 0.015 and each tied 4 holds 0.075, so an ascending
    # cumsum crosses 1 - 0.9 inside the tie group: one member goes, the lowest id on a stable sort
    # (rows of <= 16 tokens: torch's sort is an insertion sort there, stable).
    z = [6, 5, 4, 4, 4, 2, 1, 0]
    assert one_row(z, "exact", top_p=0.9) == [0, 1, 2, 3, 4]
    assert one_row(z, "vllm", top_p=0.9) == [0, 1, 3, 4]
    assert one_row(z, "hf", top_p=0.9) == [0, 1, 3, 4]
    # SGLang counts from the top: 0, 1 and the first two of the tie group reach 0.9
    assert one_row(z, "sglang", top_p=0.9) == [0, 1, 2, 3]


def test_top_k_tie_at_the_kth_value():
    z = [6, 5, 4, 4, 4, -INF, -INF]
    for profile in ("exact", "vllm", "hf"):
        assert one_row(z, profile, top_k=3) == [0, 1, 2, 3, 4], profile
    # SGLang keeps exactly k. With a full sort (a batch where some row has no top-k) the stable
    # small-row sort puts the lowest ids first:
    rows = support([z, z], "sglang", top_k=torch.tensor([3, 0]))
    assert rows[0] == [0, 1, 2]
    # when every row has a top-k SGLang takes torch.topk over the largest k: exactly 3 tokens, the
    # two above the tie and ONE tied token, which one being torch.topk's accident (not asserted)
    only = one_row(z, "sglang", top_k=3)
    assert len(only) == 3 and only[:2] == [0, 1] and only[2] in (2, 3, 4)


def test_composition_sglang_joint_top_p():
    z = [math.log(q) for q in (0.4, 0.3, 0.2, 0.1)]
    # SGLang: the mass above token 2 in the FULL distribution is 0.7 <= 0.75, so it stays;
    # the others renormalise over the top 3 first: above token 2 is 0.7/0.9 = 0.78 >= 0.75.
    assert one_row(z, "sglang", top_k=3, top_p=0.75) == [0, 1, 2]
    for profile in ("exact", "vllm", "hf"):
        assert one_row(z, profile, top_k=3, top_p=0.75) == [0, 1], profile


def test_composition_min_p_after_top_p_in_transformers():
    z = [0.0, -0.3, -0.6] + [-3.5] * 200
    # min-p first (exact, vLLM): the tail is below 0.05 of the top and goes; top-p 0.7 over
    # {0,1,2} (0.40, 0.30, 0.22) keeps {0,1}. top-p first over the full row (transformers, and
    # SGLang's joint cut): the 200 tail tokens hold most mass, so {0,1,2} and part of the tail
    # pass top-p, and min-p then removes that tail.
    assert one_row(z, "exact", top_p=0.7, min_p=0.05) == [0, 1]
    assert one_row(z, "vllm", top_p=0.7, min_p=0.05) == [0, 1]
    assert one_row(z, "hf", top_p=0.7, min_p=0.05) == [0, 1, 2]
    assert one_row(z, "sglang", top_p=0.7, min_p=0.05) == [0, 1, 2]


def test_min_p_in_probability_space_versus_logit_space():
    a = torch.tensor(3.7)
    b = a + torch.tensor(math.log(0.05), dtype=torch.float32)  # exactly on the logit-space line
    c = torch.nextafter(b, torch.tensor(10.0))
    z = torch.stack([a, b, c]).tolist()
    assert one_row(z, "exact", min_p=0.05) == [0, 1, 2]
    # float32 probabilities: both fall a hair below 0.05 * p_max after rounding
    for profile in ENGINES:
        assert one_row(z, profile, min_p=0.05) == [0], profile


def test_float32_top_p_threshold():
    z = [math.log(19), 0.0]  # the mass above token 1 is 0.95 - 2e-9
    assert one_row(z, "exact", top_p=0.95) == [0, 1]
    # ascending: token 1 holds 0.05 in float32, <= float32(1 - 0.95) -> dropped
    assert one_row(z, "vllm", top_p=0.95) == [0]
    assert one_row(z, "hf", top_p=0.95) == [0]
    # SGLang: exclusive cumsum of token 1 = float32(0.95) = float32(p), not > p -> kept
    assert one_row(z, "sglang", top_p=0.95) == [0, 1]


def test_fp32_underflow_with_top_p_one():
    z = [0.0, -1.0, -120.0, -130.0]  # exp(-120) underflows float32
    assert one_row(z, "exact", top_p=1.0) == [0, 1, 2, 3]
    # vLLM's top-p pass runs for the whole batch once a row has p < 1, and there a row with
    # p = 1 loses the tokens at cumsum == 0 <= 1 - 1
    rows = support([z, z], "vllm", top_p=torch.tensor([1.0, 0.999]))
    assert rows[0] == [0, 1]
    assert one_row(z, "vllm", top_p=1.0) == [0, 1, 2, 3]  # no row with p < 1: vLLM passes p = None
    assert one_row(z, "vllm") == [0, 1, 2, 3]
    assert one_row(z, "hf", top_p=1.0) == [0, 1, 2, 3]  # generate adds no top-p warper at p = 1
    # SGLang samples from float32 probabilities: tokens at probability 0 cannot be drawn
    assert one_row(z, "sglang", top_p=1.0) == [0, 1]


def test_sglang_top_p_one_with_top_k_drops_past_a_cumsum_of_one():
    # the float32 probabilities of tokens 0..6 sum to 1.0000001, so the exclusive cumsum of
    # token 7 (probability 6e-19, positive) is > 1 = p and SGLang's joint top-p drops it
    z = [-1.5, 0.25, 1.75, 0.0, 1.5, -0.25, -0.25, -40.0]
    assert one_row(z, "sglang", top_k=8, top_p=1.0) == [0, 1, 2, 3, 4, 5, 6]
    for profile in ("exact", "vllm", "hf"):
        assert one_row(z, profile, top_k=8, top_p=1.0) == list(range(8)), profile


def test_all_minus_inf_rows():
    z = torch.tensor([[-INF, -INF, -INF], [0.0, 1.0, -INF]])
    with pytest.raises((ValueError, RuntimeError), match="row 0"):
        mask_replay.capture(z, top_p=0.9)
    for profile in ENGINES:
        rows = support(z, profile, top_p=0.9, min_p=0.1)
        assert rows == [[], [0, 1]], profile
    # a sampled token in an empty row is outside its support
    with pytest.raises(OutsideSupportError, match="row 0"):
        mask_replay.capture(z, top_p=0.9, profile="vllm", sampled=torch.tensor([0, 1]))


# ---- the engines' own test cases --------------------------------------------------------------------
def test_vllm_topp_tie_break_deterministic():
    # vLLM tests/v1/sample/test_topk_topp_sampler.py::test_topp_tie_break_deterministic: 1000
    # tokens at 1.0, 1000 at 0.0, the rest -inf, p = 0.5. Each 1.0 holds e/(1000(e + 1)) =
    # 7.31e-4, the 0.0 group 0.2689 in all; an ascending cumsum stays <= 0.5 through the zeros and
    # 316 of the ones ((0.5 - 0.2689) / 7.31e-4 = 316.06), so the sort path keeps 684.
    v = 128256
    logits = torch.full((2, v), -INF)
    logits[:, :1000] = 1.0
    logits[:, 1000:2000] = 0.0
    mask = mask_replay.capture(logits, top_p=0.5, profile="vllm")
    assert mask.lengths().tolist() == [684, 684]
    assert int(mask.token_ids.max()) < 1000
    exact = mask_replay.capture(logits, top_p=0.5)
    assert exact.lengths().tolist() == [1000, 1000]  # the whole tie group, order-independent
    again = mask_replay.capture(logits, top_p=0.5, profile="vllm")
    assert torch.equal(mask.token_ids, again.token_ids)  # deterministic on one build


def test_vllm_top_k_only_matches_sorted_path():
    # vLLM's test_topk_impl_equivalence: the top-k-only path (torch.topk threshold) and the sort
    # path give the same support; here: k per row, with and without a top-p pass at p = 1
    g = torch.Generator().manual_seed(3)
    z = torch.randn(16, 300, generator=g)
    k = torch.randint(1, 40, (16,), generator=g)
    only = support(z, "vllm", top_k=k)
    with_pass = support(z, "vllm", top_k=k, top_p=1.0)
    assert only == with_pass
    assert [len(r) for r in only] == k.tolist()  # continuous random logits: no ties


def test_vllm_extreme_k_and_p_values():
    # vLLM's test_extreme_k_values / test_extreme_p_values (Triton vs the PyTorch path): k = 1
    # keeps 1, k = V keeps all, mixed k keeps exactly k on continuous logits; p = 1 keeps all, a
    # very small p keeps only the top token, and a p = 1 row next to p < 1 rows keeps all (no
    # probability underflows on these logits)
    g = torch.Generator().manual_seed(42)
    v = 1024
    z = torch.randn(16, v, generator=g)
    k = torch.tensor([1, v, 2, v - 1] * 4)
    assert [len(r) for r in support(z, "vllm", top_k=k)] == k.tolist()
    assert [len(r) for r in support(z, "vllm", top_k=1)] == [1] * 16
    assert [len(r) for r in support(z, "vllm", top_p=1.0)] == [v] * 16
    assert [len(r) for r in support(z, "vllm", top_p=0.0001)] == [1] * 16
    mixed = support(z, "vllm", top_p=torch.tensor([0.1, 0.5, 0.9, 1.0] * 4))
    assert [len(r) for r in mixed[3::4]] == [v] * 4
    assert all(len(a) < len(b) < len(c) < v for a, b, c in zip(mixed[0::4], mixed[1::4], mixed[2::4]))


def test_vllm_hf_alignment_example():
    # vLLM PR #1885 ("Aligning top_p and top_k sampling") example: [0.1, 0.2, 0.3, 0.4], k = 2,
    # p = 0.5: top-k first gives (0.57, 0.43) and top-p keeps only 0.4; SGLang's joint cut keeps
    # both (the mass above 0.3 in the full distribution, 0.4, is below 0.5).
    z = [math.log(q) for q in (0.1, 0.2, 0.3, 0.4)]
    for profile in ("exact", "vllm", "hf"):
        assert one_row(z, profile, top_k=2, top_p=0.5) == [3], profile
    assert one_row(z, "sglang", top_k=2, top_p=0.5) == [2, 3]


def test_sglang_joint_cut_keeps_the_token_that_crosses_p():
    # SGLang's cut-off keeps a token while the mass strictly before it is <= p, so the token that
    # crosses p stays (probabilities 0.5, 0.3, 0.2 at p = 0.5: the mass before 0.3 is 0.5, kept;
    # before 0.2 is 0.8, dropped), also with a top-k above the cut
    z = [math.log(q) for q in (0.5, 0.3, 0.2)]
    assert one_row(z, "sglang", top_p=0.5) == [0, 1]
    assert one_row(z, "sglang", top_p=0.5, top_k=3) == [0, 1]
    assert one_row(z, "sglang", top_p=0.49) == [0]


# ---- greedy, per-row parameters, errors -------------------------------------------------------------
def test_greedy_rows_per_profile():
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 1.0]])
    for profile in PROFILES:
        assert support(z, profile, temperature=0.0, top_p=0.5) == [[1], [0]], profile
    # vLLM samples greedily below T = 1e-5, SGLang below 1e-6: one token either way
    assert support(z, "vllm", temperature=5e-6) == [[1], [0]]
    assert support(z, "sglang", temperature=5e-7) == [[1], [0]]


def test_per_row_parameters_match_rows_one_by_one():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 50, generator=g) * 2
    t = torch.tensor([0.5, 1.0, 1.5, 0.7, 1.0, 2.0])
    p = torch.tensor([0.9, 0.5, 0.99, 0.3, 1.0, 0.8])
    mp = torch.tensor([0.0, 0.05, 0.1, 0.0, 0.2, 0.01])
    for profile in ("vllm", "hf"):  # no batch-level switch beyond "top-p given at all"
        rows = support(z, profile, temperature=t, top_p=p, min_p=mp)
        for r in range(6):
            alone = one_row(z[r], profile, temperature=float(t[r]), top_p=float(p[r]), min_p=float(mp[r]))
            assert rows[r] == alone, (profile, r)


@pytest.mark.parametrize("profile", ENGINES)
def test_bad_input_names_the_problem(profile):
    z = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 1.5 in row 2"):
        mask_replay.capture(z, top_p=torch.tensor([0.5, 0.9, 1.5]), profile=profile)
    with pytest.raises(ValueError, match="temperature"):
        mask_replay.capture(z, temperature=torch.tensor([1.0, -1.0, 1.0]), profile=profile)
    bad = z.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="row 1, column 2"):
        mask_replay.capture(bad, profile=profile)
    bad[1, 2] = INF
    with pytest.raises(ValueError, match="row 1, column 2"):
        mask_replay.capture(bad, profile=profile)
    with pytest.raises(ValueError, match="overflows"):
        mask_replay.capture(torch.full((1, 2), 3e38), temperature=0.5, profile=profile)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        mask_replay.capture(torch.zeros(4), profile=profile)


def test_unknown_profile():
    with pytest.raises(ValueError, match="profile must be one of exact, vllm, sglang, hf; got 'trtllm'"):
        mask_replay.capture(torch.zeros(1, 3), profile="trtllm")
    with pytest.raises(ValueError, match="engine profiles"):
        engine_support(torch.zeros(1, 3), "exact")


# ---- metadata and sampled ----------------------------------------------------------------------------
def test_semantics_name_the_profile(tmp_path):
    z = torch.randn(4, 30)
    for profile in PROFILES:
        mask = mask_replay.capture(z, top_p=0.9, profile=profile)
        assert mask.metadata["semantics"] == semantics(profile)
        path = tmp_path / f"{profile}.safetensors"
        mask.save(path)
        back = mask_replay.SamplingMask.load(path)
        assert back.metadata["semantics"] == semantics(profile)
    assert semantics("exact") == SEMANTICS
    assert semantics("vllm") == SEMANTICS + "+profile=vllm"


@pytest.mark.parametrize("profile", ENGINES)
def test_sampled_logprobs_and_kept_mass_over_the_profile_support(profile):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(8, 64, generator=g) * 3
    sampled = z.argmax(1)
    t = 0.8
    mask = mask_replay.capture(z, temperature=t, top_p=0.9, top_k=20, sampled=sampled, profile=profile)
    for r in range(8):
        ids = mask.token_ids[mask.offsets[r]:mask.offsets[r + 1]].long()
        x = z[r].double() / t
        lse_k = torch.logsumexp(x[ids], 0)
        assert float(mask.logprobs[r]) == pytest.approx(float(x[sampled[r]] - lse_k), abs=1e-5)
        assert float(mask.kept_mass[r]) == pytest.approx(float(torch.exp(lse_k - torch.logsumexp(x, 0))), abs=1e-5)


# ---- random rows: exact is today's kernel; engines agree with float64 references ---------------------
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 5, 40]), st.sampled_from([None, 0.5, 0.9, 1.0]),
       st.sampled_from([None, 0, 3, 10]), st.sampled_from([None, 0.0, 0.05]), st.sampled_from([0.0, 0.7, 1.0]))
def test_exact_profile_is_todays_kernel(seed, n, top_p, top_k, min_p, t):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, 97, generator=g) * 3).to(torch.bfloat16)  # bf16: plenty of ties
    kw = dict(temperature=t, top_p=top_p, top_k=top_k, min_p=min_p)
    default = mask_replay.capture(z, **kw)
    exact = mask_replay.capture(z, profile="exact", **kw)
    assert exact == default and exact.metadata == default.metadata
    params = mask_replay.params.expand_params(n, z.device, t, top_k, top_p, min_p)
    ops = torch.ops.mask_replay.capture(z, *params, False)
    assert torch.equal(exact.token_ids, ops[0]) and torch.equal(exact.offsets, ops[1])


MARGIN = 1e-4  # the references skip rows with a threshold this close: no boundary tie, no rounding call


def _ref_vllm(x, k, p, mp):
    """Documented vLLM order in float64: min-p (probability space), top-k by value, top-p on the
    renormalised survivors (ascending: drop while the cumulative mass <= 1 - p, keep the top)."""
    prob = torch.softmax(x, 0)
    mp = mp or 0.0
    keep = prob >= mp * prob.max()
    margins = [float((prob - mp * prob.max()).abs().min())] if mp else [1.0]
    if k:
        kth = torch.sort(x[keep], descending=True).values[min(k, int(keep.sum())) - 1]
        keep &= x >= kth
    if p is not None:
        _cut_top_p_ascending(x, keep, p, margins)
    return keep, min(margins)


def _cut_top_p_ascending(x, keep, p, margins):
    """vLLM's and transformers' top-p on the survivors, in float64: renormalise, sort ascending,
    drop while the cumulative mass is <= 1 - p (never the largest); records the closest margin."""
    q = torch.softmax(torch.where(keep, x, -INF), 0)
    asc = torch.argsort(torch.where(keep, x, -INF))[-int(keep.sum()):]
    cum = torch.cumsum(q[asc], 0)
    drop = cum <= 1 - p
    drop[-1] = False
    if len(cum) > 1:
        margins.append(float((cum[:-1] - (1 - p)).abs().min()))
    keep[asc[drop]] = False


def _ref_sglang(x, k, p, mp):
    """SGLang's joint cut in float64: rank < k, mass strictly before the token <= p (in the full
    distribution), p_i >= min_p * p_max."""
    prob = torch.softmax(x, 0)
    order = torch.argsort(x, descending=True)
    before = torch.cumsum(prob[order], 0) - prob[order]
    keep_sorted = torch.ones_like(before, dtype=torch.bool)
    if k:
        keep_sorted[k:] = False
    margins = [1.0]
    if p is not None:
        keep_sorted &= before <= p
        margins.append(float((before - p).abs().min()))
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    if mp:
        keep &= prob >= mp * prob.max()
        margins.append(float((prob - mp * prob.max()).abs().min()))
    return keep & (prob > 0), min(margins)


def _ref_hf(x, k, p, mp):
    """transformers' order in float64: top-k, top-p (ascending, drop while cum <= 1 - p), then
    min-p over the renormalised survivors."""
    keep = torch.ones_like(x, dtype=torch.bool)
    margins = [1.0]
    if k:
        keep &= x >= torch.sort(x, descending=True).values[min(k, x.numel()) - 1]
    if p is not None and p < 1:
        _cut_top_p_ascending(x, keep, p, margins)
    if mp:
        q = torch.softmax(torch.where(keep, x, -INF), 0)
        keep &= q >= mp * q.max()
        margins.append(float((q[keep | (q > 0)] - mp * q.max()).abs().min()))
    return keep, min(margins)


REFERENCES = {"vllm": _ref_vllm, "sglang": _ref_sglang, "hf": _ref_hf}


@pytest.mark.parametrize("profile", ENGINES)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 300), scale=st.sampled_from([0.5, 2.0, 6.0]),
       k=st.sampled_from([None, 1, 5, 50]), p=st.sampled_from([None, 0.3, 0.8, 0.95]),
       mp=st.sampled_from([None, 0.02, 0.2]), t=st.sampled_from([0.6, 1.0, 1.7]))
def test_engine_profiles_match_float64_references_away_from_ties(profile, seed, v, scale, k, p, mp, t):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=g, dtype=torch.float64).float() * scale
    assume(torch.unique(z).numel() == v)  # no ties at all, so no boundary tie
    x = (z / t).double()
    keep_ref, margin = REFERENCES[profile](x, k, p, mp)
    assume(margin > MARGIN)
    got = one_row(z, profile, temperature=t, top_k=k, top_p=p, min_p=mp)
    assert got == torch.nonzero(keep_ref).flatten().tolist()


# ---- log-prob mismatch --------------------------------------------------------------------------------
def test_compare_logprobs_codes_each_cause():
    engine = torch.tensor([-1.0, -0.5, -2.0, -3.0, -1.0, float("nan"), -1.00001])
    captured = torch.tensor([-1.0, -0.7, -1.5, -2.0, -INF, -1.0, -1.0])
    full = torch.tensor([-9.0, -9.0, -9.0, -3.0, -9.0, -9.0, -9.0])
    code = compare_logprobs(engine, captured, [full], tolerance=1e-4)
    assert code.tolist() == [0, 1, 2, 3, 4, 5, 0]
    report = summarise(code, engine, captured, 1e-4)
    assert report["rows"] == 5 and report["rows_compared"] == 7
    assert report["worst_row"] == 3 and report["worst_gap"] == pytest.approx(1.0)
    assert set(report["by_cause"].values()) == {1}
    assert report["likely_cause"] in {CAUSES[c] for c in (1, 2, 3, 4, 5)}
    with pytest.raises(ValueError, match="shape"):
        compare_logprobs(engine[:3], captured, [])
    assert summarise(torch.zeros(3, dtype=torch.int8), engine[:3], engine[:3]) == {
        "tolerance": 1e-4, "rows_compared": 3, "rows": 0}
