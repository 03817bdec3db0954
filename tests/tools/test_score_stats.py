"""ReportStream (score's report in bounded memory) against build_report, the in-memory float64
computation on whole arrays: the same report for any split of the tokens into batches."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mask_replay.tools import score_stats
from mask_replay.tools.score_stats import ExactSum, ReportStream, float_keys, key_floats
from mask_replay.trainer.metrics import build_report
from tests.helpers import assert_same_report, report_scales


def _stream_report(batches, cols, has_step, has_seq, has_kl):
    with ReportStream(has_step, has_seq, has_kl) as s:
        for a, b in batches:
            s.add(*[None if c is None else c[a:b] for c in cols])
        return s.report()


def _splits(n, size):
    return [(a, min(n, a + size)) for a in range(0, n, size)] or [(0, 0)]


tokens = st.integers(0, 60).flatmap(lambda n: st.tuples(
    st.just(n),
    st.integers(0, 2 ** 32 - 1),
    st.sampled_from(["mixed", "ties", "overflow", "tiny"]),
    st.booleans(), st.booleans(), st.booleans()))


def _columns(n, seed, kind, has_step, has_seq, has_kl):
    g = np.random.default_rng(seed)
    rollout = g.normal(-2, 1, n).astype(np.float32).astype(np.float64)
    noise = {"mixed": g.normal(0, 0.1, n), "ties": g.integers(-2, 3, n) * 0.05,
             "overflow": g.choice([0.0, 800.0, -800.0, 1e-3], n), "tiny": g.normal(0, 1e-7, n)}[kind]
    replay = (rollout + noise * 0.1).astype(np.float32).astype(np.float64)
    no_replay = (rollout + noise).astype(np.float32).astype(np.float64)
    kept = g.uniform(0.5, 1, n).astype(np.float32).astype(np.float64)
    step = g.integers(0, 3, n) if has_step else None
    seq = g.integers(-2, 4, n) if has_seq else None  # sequences recur, in any order
    kl = g.exponential(1e-3, n) if has_kl else None
    return [rollout, replay, no_replay, kept, step, seq, kl]


@pytest.mark.parametrize("batch", [1, 7, None])
@pytest.mark.parametrize("waiting, load", [(3, 0), (3, score_stats.LOAD_LIMIT), (score_stats.BATCH, 0)])
@given(tokens)
def test_stream_equals_the_in_memory_report(batch, waiting, load, case):
    n, seed, kind, has_step, has_seq, has_kl = case
    cols = _columns(n, seed, kind, has_step, has_seq, has_kl)
    want = build_report(*cols)
    # few tokens waiting: many sorted runs, many flushes; LOAD_LIMIT 0: every median by bisection
    old = score_stats.BATCH, score_stats.LOAD_LIMIT
    score_stats.BATCH, score_stats.LOAD_LIMIT = waiting, load
    try:
        got = _stream_report(_splits(n, batch or max(n, 1)), cols, has_step, has_seq, has_kl)
    finally:
        score_stats.BATCH, score_stats.LOAD_LIMIT = old
    assert_same_report(got, want, report_scales(*cols))


@pytest.mark.parametrize("load", [0, score_stats.LOAD_LIMIT])
def test_medians_are_exact_for_even_odd_ties_and_signed_zeros(monkeypatch, load):
    monkeypatch.setattr(score_stats, "LOAD_LIMIT", load)
    d = np.array([0.0, -0.0, 1e-300, -1e-300, 3.0, 3.0, -5.0, np.inf, -np.inf, 0.25])
    for n in range(1, d.size + 1):
        for perm in (np.arange(n), np.arange(n)[::-1]):
            with ReportStream(False, False, False) as s:
                spill = s.spill["replay"]
                for i in perm:  # one run per value: the selection spans n sorted runs
                    spill.add(np.zeros(1, np.int64), d[i: i + 1])
                with np.errstate(over="ignore"):
                    assert spill.median() == np.median(np.exp(d[:n])), n


def test_a_nan_d_makes_its_groups_median_nan_only():
    with ReportStream(True, False, False) as s:
        spill = s.spill["replay"]
        spill.add(np.array([0, 1, 1]), np.array([0.1, np.nan, 0.2]))
        assert spill.median(0) == math.exp(0.1)
        assert math.isnan(spill.median(1)) and math.isnan(spill.median())


def test_float_keys_order_as_the_floats():
    x = np.array([-np.inf, -1e308, -1.0, -5e-324, -0.0, 0.0, 5e-324, 1.0, 1e308, np.inf])
    k = float_keys(x)
    assert (np.diff(k.astype(object)) > 0).all()
    assert np.array_equal(key_floats(k).view(np.uint64), x.view(np.uint64))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=40))
def test_exact_sum_is_fsum(xs):
    s = ExactSum()
    for x in xs:
        s.add(x)
    try:
        want = math.fsum(xs)
    except OverflowError:
        return  # an overflowing exact sum: ExactSum says inf (checked below)
    assert s.value() == want


def test_exact_sum_non_finite_and_overflow_as_numpy():
    for xs in ([1.0, np.inf, 2.0], [np.inf, -np.inf], [np.nan, 1.0], [1e308, 1e308], [-1e308, -1e308, 1.0]):
        s = ExactSum()
        for x in xs:
            s.add(x)
        with np.errstate(all="ignore"):
            want = float(np.sum(np.array(xs)))
        assert s.value() == want or (math.isnan(s.value()) and math.isnan(want)), xs


def test_the_report_of_no_tokens_is_the_in_memory_one():
    e = np.zeros(0)
    z = np.zeros(0, np.int64)
    want = build_report(e, e, e, e, z, z, e)
    with ReportStream(True, True, True) as s:
        got = s.report()
    assert_same_report(got, want)


def test_the_median_files_have_no_name(tmp_path):
    """Unlinked when made: nothing is left in the folder even by a run that is killed."""
    with ReportStream(True, False, False, folder=str(tmp_path)) as s:
        s.add(*(np.ones(4) for _ in range(4)), np.arange(4))
        assert s.report()["replay"]["importance_ratio_median"] == 1.0
        assert s.spill["replay"].written == 8  # by step, and all steps together
        assert list(tmp_path.iterdir()) == []
