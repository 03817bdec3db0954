"""CPU capture kernel against the independent reference (tests/helpers.py)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay
from tests.helpers import reference_logprob_and_mass, reference_support

ops = torch.ops.mask_replay


def assert_matches_reference(logits, exact=False, **params):
    mask = mask_replay.capture(logits, **params)
    n, v = logits.shape
    mask.validate(vocab_size=v)
    dense = mask.to_dense(v)
    strict, loose = reference_support(logits, **params)
    for r in range(n):
        assert bool((strict[r] <= dense[r]).all()), f"row {r}: kernel misses tokens the reference keeps"
        assert bool((dense[r] <= loose[r]).all()), f"row {r}: kernel keeps tokens the reference drops"
        if exact:
            assert torch.equal(strict[r], loose[r]), f"row {r}: test case sits on a top-p boundary"
    return mask


def llm_like(n, v, seed=0, dtype=torch.float32):
    """Heavy-tailed logits: a few strong candidates over a long flat tail, as LLM heads produce."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g) * 2.0 - 8.0
    heads = torch.randint(0, v, (n, 6), generator=g)
    base.scatter_(1, heads, torch.randn(n, 6, generator=g) * 2.0 + 6.0)
    return base.to(dtype)


# ---- edge cases --------------------------------------------------------------------------------
def test_vocab_of_one():
    x = torch.tensor([[0.5], [-3.0]])
    for kw in [{}, {"top_p": 0.1}, {"top_k": 1}, {"min_p": 1.0}, {"temperature": 0.0}]:
        assert mask_replay.capture(x, **kw).to_lists() == [[0], [0]]


def test_no_rows():
    mask = mask_replay.capture(torch.zeros(0, 10), top_p=0.9)
    assert mask.num_rows == 0 and mask.nnz == 0 and mask.offsets.tolist() == [0]


def test_all_tied_row_keeps_everything():
    x = torch.zeros(3, 50)
    for kw in [{"top_k": 5}, {"top_p": 0.01}, {"min_p": 1.0}]:
        assert mask_replay.capture(x, **kw).lengths().tolist() == [50, 50, 50]


def test_ties_at_kth_value_are_kept():
    x = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]])
    assert mask_replay.capture(x, top_k=2).to_lists() == [[0, 1, 2, 3]]
    assert mask_replay.capture(x, top_k=4).to_lists() == [[0, 1, 2, 3]]
    assert mask_replay.capture(x, top_k=5).to_lists() == [[0, 1, 2, 3, 4]]


def test_tie_group_at_top_p_boundary_kept_whole():
    # The mass strictly above each of three equal logits is 0, so all three stay even for a p far
    # below their combined mass; the token after them is dropped.
    x = torch.tensor([[1.0, 1.0, 1.0, -5.0]])
    assert mask_replay.capture(x, top_p=0.05).to_lists() == [[0, 1, 2]]
    # A tie group below the top: masses 1 : e^-1 : e^-1. Mass above the pair is 1/(1 + 2/e)
    # ~ 0.576, so p = 0.5 drops the pair and p = 0.6 keeps both (never one of them alone).
    y = torch.tensor([[0.0, -1.0, -1.0]])
    assert mask_replay.capture(y, top_p=0.5).to_lists() == [[0]]
    assert mask_replay.capture(y, top_p=0.6).to_lists() == [[0, 1, 2]]


def test_top_p_keeps_until_the_mass_above_reaches_p():
    # masses 1/2, 1/4, 1/4 (up to rounding): p = 0.4 keeps only the first, p = 0.6 all three
    # (the tied pair has 1/2 above it), p = 0.5 sits on the boundary and the reference decides.
    x = torch.tensor([[0.0, math.log(0.5), math.log(0.5)]], dtype=torch.float32)
    assert mask_replay.capture(x, top_p=0.4).to_lists() == [[0]]
    assert mask_replay.capture(x, top_p=0.6).to_lists() == [[0, 1, 2]]
    assert_matches_reference(x, top_p=0.5)
    # a strict chain 0.5 > 0.3 > 0.2: the third token needs p > 0.8
    y = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert mask_replay.capture(y, top_p=0.79).to_lists() == [[0, 1]]
    assert mask_replay.capture(y, top_p=0.81).to_lists() == [[0, 1, 2]]


def test_neg_inf_never_in_support():
    x = torch.tensor([[float("-inf"), 0.0, float("-inf"), -1.0]])
    for kw in [{}, {"top_k": 10}, {"top_p": 1.0}, {"min_p": 0.0}, {"top_p": 0.9999}]:
        mask = mask_replay.capture(x, **kw)
        assert 0 not in mask.row(0).tolist() and 2 not in mask.row(0).tolist()


def test_greedy_rows_take_the_first_argmax():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("-inf"), -1.0, -1.0, -2.0]])
    assert mask_replay.capture(x, temperature=0.0, top_p=0.5).to_lists() == [[1], [1]]


def test_switches_that_mean_off():
    x = llm_like(4, 500)
    full = [list(range(500))] * 4
    assert mask_replay.capture(x, top_k=0).to_lists() == full
    assert mask_replay.capture(x, top_k=-3).to_lists() == full
    assert mask_replay.capture(x, top_k=500).to_lists() == full
    assert mask_replay.capture(x, top_k=10_000).to_lists() == full
    assert mask_replay.capture(x, top_p=1.0).to_lists() == full
    assert mask_replay.capture(x, min_p=0.0).to_lists() == full


def test_min_p_one_keeps_the_maxima_only():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert mask_replay.capture(x, min_p=1.0).to_lists() == [[1, 2]]


def test_negative_zero_ties_with_zero():
    x = torch.tensor([[0.0, -0.0, -1.0, -2.0]])
    assert mask_replay.capture(x, top_k=1).to_lists() == [[0, 1]]


def test_per_row_mixed_parameters():
    x = llm_like(6, 3000, seed=3)
    params = dict(
        temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.5]),
        top_k=torch.tensor([0, 20, 5, 0, 1, 100]),
        top_p=torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.8]),
        min_p=torch.tensor([0.0, 0.05, 0.0, 0.0, 0.2, 0.01]),
    )
    assert_matches_reference(x, **params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_many_ties(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(-6, 3, (16, 777), generator=g).float() * 0.5).to(dtype)
    for kw in [{"top_k": 7}, {"top_p": 0.7}, {"top_k": 40, "top_p": 0.9, "temperature": 0.8},
               {"min_p": 0.3}]:
        assert_matches_reference(x, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [{"top_p": 0.95}, {"top_k": 50}, {"top_p": 0.9, "top_k": 100, "temperature": 0.6},
                                {"min_p": 0.05, "top_p": 0.99}, {"top_p": 0.5, "temperature": 1.7}])
def test_llm_like_rows(dtype, kw):
    assert_matches_reference(llm_like(8, 32000, seed=7, dtype=dtype), **kw)


@pytest.mark.slow
def test_huge_vocab_and_wide_supports():
    # flat rows drive the support past the filtering buffer into the histogram path
    x = torch.randn(3, 262144)
    for kw in [{"top_p": 0.95}, {"top_p": 0.3}, {"top_k": 30000}, {"top_k": 5}, {"top_k": 100000, "top_p": 0.9}]:
        assert_matches_reference(x, **kw)


def test_results_do_not_depend_on_thread_count():
    x = llm_like(33, 5000, seed=11)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = mask_replay.capture(x, top_p=0.9, top_k=200)
        torch.set_num_threads(max(2, old))
        b = mask_replay.capture(x, top_p=0.9, top_k=200)
    finally:
        torch.set_num_threads(old)
    assert a == b


def test_non_contiguous_logits():
    x = llm_like(8, 1000)
    strided = torch.cat([x, x], dim=1)[:, ::2]
    col_major = x.t().contiguous().t()
    ref = mask_replay.capture(x[:, : x.shape[1]], top_p=0.9)
    assert mask_replay.capture(col_major, top_p=0.9) == ref
    assert mask_replay.capture(strided, top_p=0.9) == mask_replay.capture(strided.contiguous(), top_p=0.9)


# ---- random cases --------------------------------------------------------------------------------
@st.composite
def capture_case(draw):
    n = draw(st.integers(0, 5))
    v = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    levels = draw(st.sampled_from([None, 3, 20]))  # few levels -> many ties
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * draw(st.sampled_from([0.5, 2.0, 8.0]))
    if levels:
        x = torch.round(x * levels / 4) / (levels / 4)
    if draw(st.booleans()) and n and v > 1:
        x[torch.rand(n, v, generator=g) < 0.2] = float("-inf")
        x[:, 0] = torch.randn(n, generator=g)  # keep a finite entry per row
    x = x.to(dtype)

    def param(kind):
        per_row = draw(st.booleans())
        if kind == "t":
            vals = st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5])
        elif kind == "k":
            vals = st.integers(-1, v + 2)
        elif kind == "p":
            vals = st.sampled_from([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
        else:
            vals = st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0])
        if per_row:
            return torch.tensor([draw(vals) for _ in range(n)], dtype=torch.long if kind == "k" else torch.float32)
        return draw(st.one_of(st.none(), vals)) if kind != "t" else draw(vals)

    return x, dict(temperature=param("t"), top_k=param("k"), top_p=param("p"), min_p=param("m"))


@given(capture_case())
def test_random_against_reference(case):
    x, params = case
    assert_matches_reference(x, **params)


@given(
    v=st.integers(1100, 8000),
    std=st.floats(0.02, 0.6),
    p=st.floats(0.99, 0.99999),
    seed=st.integers(0, 2**31 - 1),
)
def test_flat_rows_with_a_wide_top_p_do_not_depend_on_column_order(v, std, p, seed):
    # Nearly flat rows put thousands of tokens in the support, so the CPU kernel's filtering scan
    # compacts its buffer several times before the buffer's mass reaches p * Z: the threshold it
    # raises to must not depend on which columns came first.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, v, generator=g) * std
    perm = torch.randperm(v, generator=g)
    dense = assert_matches_reference(x, top_p=p).to_dense(v)
    permuted = mask_replay.capture(x[:, perm], top_p=p).to_dense(v)
    assert torch.equal(permuted, dense[:, perm]), "the support depends on the column order"


def test_top_p_threshold_more_than_16_below_the_max():
    # The tail 17 below the max holds over 4% of the mass: the histogram of the entries within 16
    # of the max cannot bound the top-p 0.99 threshold, so the kernel takes its cut-off scan.
    g = torch.Generator().manual_seed(7)
    x = torch.full((1, 1 << 20), -17.0) + torch.randn(1, 1 << 20, generator=g) * 0.3
    x[0, 0] = 0.0
    mask = assert_matches_reference(x, top_p=0.99)
    assert 1 < mask.nnz < x.shape[1]


# ---- sampled, logprobs, kept mass ------------------------------------------------------------------
def test_sampled_logprobs_and_kept_mass():
    x = llm_like(32, 4000, seed=5)
    t = torch.rand(32) + 0.5
    mask = mask_replay.capture(x, temperature=t, top_p=0.9)
    sampled = torch.tensor([int(r[torch.randint(0, len(r), (1,))]) for r in map(torch.tensor, mask.to_lists())])
    mask = mask_replay.capture(x, temperature=t, top_p=0.9, sampled=sampled)
    lp, km = reference_logprob_and_mass(x, mask.to_dense(4000), sampled, t)
    torch.testing.assert_close(mask.logprobs.double(), lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mask.kept_mass.double(), km, rtol=1e-5, atol=1e-6)
    assert torch.equal(mask.sampled, sampled)
    assert bool((mask.kept_mass <= 1.0 + 1e-6).all()) and bool((mask.kept_mass < 0.9999).any())


def test_sampled_outside_support_errors_or_flags():
    x = torch.tensor([[5.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="row 0"):
        mask_replay.capture(x, top_k=1, sampled=torch.tensor([2, 1]))
    mask = mask_replay.capture(x, top_k=1, sampled=torch.tensor([2, 1]), outside="flag")
    assert mask.extras["outside_support"].tolist() == [True, False]
    assert mask.logprobs[0] == float("-inf")
    assert abs(float(mask.logprobs[1]) - math.log(1 / 3)) < 1e-6


def test_greedy_sampled():
    x = torch.tensor([[1.0, 3.0, 2.0]])
    mask = mask_replay.capture(x, temperature=0.0, sampled=torch.tensor([1]))
    assert mask.logprobs.tolist() == [0.0] and mask.kept_mass.tolist() == [1.0]


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (float("nan"), "row 1 contains NaN"),
    (float("inf"), r"row 1 contains \+inf"),
])
def test_bad_values_name_the_row(bad, match):
    x = torch.zeros(3, 8)
    x[1, 4] = bad
    with pytest.raises(RuntimeError, match=match):
        mask_replay.capture(x, top_p=0.9)
    with pytest.raises(RuntimeError, match=match):
        mask_replay.capture(x.bfloat16(), temperature=0.0)


def test_row_without_finite_entry():
    x = torch.zeros(2, 4)
    x[1] = float("-inf")
    with pytest.raises(RuntimeError, match="row 1 has no finite logit"):
        mask_replay.capture(x)


def test_overflow_after_temperature():
    x = torch.tensor([[3e38, 0.0]])
    with pytest.raises(RuntimeError, match="row 0 overflows"):
        mask_replay.capture(x, temperature=0.5)


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": torch.tensor([1.0, -2.0])}, "row 1"),
    ({"top_p": torch.tensor([0.5, 0.0])}, "row 1"),
    ({"min_p": torch.tensor([2.0, 0.0])}, "row 0"),
    ({"top_k": torch.ones(3, dtype=torch.long)}, "top_k"),
])
def test_bad_parameters(kw, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        mask_replay.capture(torch.zeros(2, 5), **kw)


def test_bad_logits_shape_and_dtype():
    with pytest.raises(ValueError, match="2-D"):
        mask_replay.capture(torch.zeros(5))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        mask_replay.capture(torch.zeros(2, 5, dtype=torch.float64))


# ---- fixed capacity ----------------------------------------------------------------------------------
def test_capture_fixed_matches_csr_and_flags_overflow():
    x = llm_like(10, 2000, seed=2)
    x[3] = 0.0  # all tied: support 2000 overflows any small width
    ids, counts, overflow = mask_replay.capture_fixed(x, 16, top_p=0.9)
    mask = mask_replay.capture(x, top_p=0.9)
    assert counts.tolist() == mask.lengths().tolist()
    assert overflow.tolist() == [c > 16 for c in mask.lengths().tolist()]
    for r, row in enumerate(mask.to_lists()):
        got = ids[r].tolist()
        assert got[: min(16, len(row))] == row[:16]
        assert all(t == -1 for t in got[len(row):])


def test_capture_fixed_flags_bad_rows_instead_of_raising():
    x = torch.zeros(3, 6)
    x[1, 2] = float("nan")
    ids, counts, overflow = mask_replay.capture_fixed(x, 4, top_k=2, temperature=torch.tensor([1.0, 1.0, -1.0]))
    assert counts.tolist() == [6, -1, -1]
    assert overflow.tolist() == [True, True, True]
    assert ids[1].tolist() == [-1] * 4


# ---- torch.library integration -----------------------------------------------------------------------
def _op_args(x, p=0.9, k=0):
    n = x.shape[0]
    return (x, torch.ones(n), torch.full((n,), k, dtype=torch.long), torch.full((n,), p, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64))


def test_opcheck_capture_ops():
    x = llm_like(4, 300)
    torch.library.opcheck(ops.capture.default, _op_args(x) + (True,))
    torch.library.opcheck(ops.capture.default, _op_args(x, 1.0, 5) + (False,))
    torch.library.opcheck(ops.capture_fixed.default, _op_args(x) + (8,))


def test_torch_compile_traces_capture():
    torch._dynamo.reset()
    x = llm_like(4, 300)

    def f(logits, t, k, p, mp):
        ids, offsets, logz = ops.capture(logits, t, k, p, mp, True)
        return ids.long().sum() + offsets[-1], logz * 2

    args = _op_args(x)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = compiled(*args)
    want = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_logz_is_full_logsumexp():
    x = llm_like(5, 3000, seed=9)
    t = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.9])
    _, _, logz = ops.capture(*_op_args(x)[:1], t, torch.zeros(5, dtype=torch.long),
                             torch.full((5,), 0.9, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), True)
    want = torch.logsumexp(x.double() / t.double()[:, None], dim=1)
    torch.testing.assert_close(logz.double(), want, rtol=1e-6, atol=1e-6)
