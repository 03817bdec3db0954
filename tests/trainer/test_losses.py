"""score_centered_pg against a dense float64 reference (values, gradients, gradcheck), the centering
property by exact enumeration over the support, |S| = 1 rows, ignored positions, metrics, errors."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mask_replay as mr
from mask_replay import SamplingMask
from mask_replay.trainer.losses import COEFFICIENT_L1, RATIO_TRUNCATED, centering_weights, surrogate
from tests.helpers import grads

INF = float("inf")


def dense_loss_ref(z_train, lq_dense, dense_mask, sampled, adv, cap, temperature=1.0):
    """Per token, over the dense [N, V] layout in float64: p from the trainer's logits renormalised
    over S, q the rollout's (-inf off S); the formula of the issue term by term."""
    x = (z_train.double() / temperature).masked_fill(~dense_mask, -INF)
    lp = torch.log_softmax(x, dim=1)
    lq = lq_dense.double()
    p, q = lp.detach().exp(), lq.exp()
    w = torch.clamp(p / torch.where(q > 0, q, torch.ones_like(q)), max=cap)
    w = torch.where(dense_mask & (q > 0), w, torch.zeros_like(w))
    y = sampled[:, None]
    w_y = w.gather(1, y)[:, 0]
    lp_y = lp.gather(1, y)[:, 0]
    coef = q * w
    centre = torch.where(dense_mask, coef * torch.where(dense_mask, lp, torch.zeros_like(lp)),
                         torch.zeros_like(lp)).sum(1)
    return -adv.double() * (w_y * lp_y - centre)


def case(seed=0, n=6, v=12, max_k=5):
    g = torch.Generator().manual_seed(seed)
    rows, sampled = [], []
    for i in range(n):
        k = 1 if i == 0 else int(torch.randint(2, max_k + 1, (1,), generator=g))
        ids = sorted(torch.randperm(v, generator=g)[:k].tolist())
        rows.append(ids)
        sampled.append(ids[int(torch.randint(0, k, (1,), generator=g))])
    mask = SamplingMask.from_lists(rows, sampled=torch.tensor(sampled))
    z_roll = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    z_train = z_roll + torch.randn(n, v, generator=g, dtype=torch.float64) * 0.7
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lq = mr.replay_support_logprobs(z_roll, mask)
    dense_lq = torch.full((n, v), -INF, dtype=torch.float64)
    dense_lq[mask.row_ids(), mask.token_ids.long()] = lq
    return mask, z_train, lq, dense_lq, adv


@pytest.mark.parametrize("cap", [2.0, 1.1, 100.0])
def test_values_and_gradients_match_dense_reference(cap):
    mask, z_train, lq, dense_lq, adv = case(seed=1)
    z = z_train.clone().requires_grad_()
    loss, metrics = mr.score_centered_pg(mr.replay_support_logprobs(z, mask), lq, mask, adv, cap=cap)
    zr = z_train.clone().requires_grad_()
    want = dense_loss_ref(zr, dense_lq, mask.to_dense(z.shape[1]), mask.sampled, adv, cap)
    assert torch.allclose(loss, want, atol=1e-12)
    loss.sum().backward()
    want.sum().backward()
    assert torch.allclose(z.grad, zr.grad, atol=1e-12)
    # the metrics by their definitions, in float64
    p, q = mr.replay_support_logprobs(z_train, mask).exp(), lq.exp()
    w = torch.clamp(p / q, max=cap)
    rows = mask.row_ids()
    l1 = torch.zeros(mask.num_rows, dtype=torch.float64).index_add(0, rows, (q * w).abs())
    assert math.isclose(float(metrics[COEFFICIENT_L1]), float(l1.mean()), rel_tol=1e-12)
    y_entry = mask.token_ids.long() == mask.sampled[rows]
    ratio_y = (p / q)[y_entry]
    assert math.isclose(float(metrics[RATIO_TRUNCATED]), float((ratio_y > cap).double().mean()), rel_tol=1e-12)


def test_gradcheck_of_the_surrogate_with_its_weights_held():
    """The weights are stop-gradient by definition, so a finite difference of the whole loss moves
    them too: gradcheck holds them at their values (computed as score_centered_pg computes them) and
    checks the surrogate's gradient through replay_support_logprobs to the logits."""
    mask, z_train, lq, _, adv = case(seed=2)
    rows = mask.row_ids()
    is_y = mask.token_ids.long() == mask.sampled[rows]
    n = mask.num_rows
    w_y, coef, _ = centering_weights(mr.replay_support_logprobs(z_train, mask), lq, rows, is_y, n, 2.0)
    z = z_train.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a: -adv * surrogate(mr.replay_support_logprobs(a, mask), w_y, coef, rows, is_y, n), (z,))
    # and score_centered_pg's own gradient is that one
    loss, _ = mr.score_centered_pg(mr.replay_support_logprobs(z, mask), lq, mask, adv)
    (g,) = torch.autograd.grad(loss.sum(), z)
    (gs,) = torch.autograd.grad((-adv * surrogate(mr.replay_support_logprobs(z, mask), w_y, coef, rows, is_y,
                                                   n)).sum(), z)
    assert torch.allclose(g, gs, atol=1e-14)


@pytest.mark.parametrize("same", [True, False])
def test_zero_gradient_in_expectation_by_enumeration(same):
    """E_{y ~ q}[grad loss] = 0 for any p (the centering), computed exactly: every y in S, weighted
    by q_y. At p = q the correction term vanishes on its own (sum_v q_v grad log p_v = 0)."""
    mask, z_train, lq, _, _ = case(seed=3, n=4, v=9)
    if same:  # rollout log-probs from the trainer's own logits: p = q
        lq = mr.replay_support_logprobs(z_train, mask)
    rows = mask.row_ids()
    for r in range(mask.num_rows):
        lo, hi = int(mask.offsets[r]), int(mask.offsets[r + 1])
        total = torch.zeros_like(z_train)
        for e in range(lo, hi):
            y = mask.sampled.clone()
            y[r] = int(mask.token_ids[e])
            z = z_train.clone().requires_grad_()
            loss, _ = mr.score_centered_pg(mr.replay_support_logprobs(z, mask), lq, mask, 1.0, sampled=y)
            (g,) = torch.autograd.grad(loss[r], z)
            total += float(lq[e].exp()) * g
        assert torch.allclose(total, torch.zeros_like(total), atol=1e-12), (r, total.abs().max())
    if same:
        z = z_train.clone().requires_grad_()
        lp = mr.replay_support_logprobs(z, mask)
        coef = lq.exp()  # w = 1 at p = q
        centre = torch.zeros(mask.num_rows, dtype=torch.float64).index_add(0, rows, coef * lp)
        (g,) = torch.autograd.grad(centre.sum(), z)
        assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)


def test_singleton_rows_give_zero_gradient_and_ignored_positions_zero():
    mask = SamplingMask.from_lists([[3], [1, 4], [2]], sampled=torch.tensor([3, 4, 2]))
    labels = torch.tensor([[-100, 3, 4], [2, -100, -100]])
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    lp = mr.replay_support_logprobs(logits, mask, labels)
    lq = torch.tensor([0.0, math.log(0.3), math.log(0.7), 0.0], dtype=torch.float64)
    loss, metrics = mr.score_centered_pg(lp, lq, mask, torch.tensor([1.0, -2.0, 3.0]), labels=labels)
    assert loss.shape == labels.shape
    assert bool((loss[labels == -100] == 0).all())
    assert loss[0, 1].item() == 0.0 and loss[1, 0].item() == 0.0  # |S| = 1: lp = 0, nothing to learn
    loss.sum().backward()
    assert not bool(logits.grad[0, 1].any()) and not bool(logits.grad[1, 0].any())
    assert not bool(logits.grad[labels == -100].any())
    assert bool(logits.grad[0, 2].any())
    assert 0.0 <= float(metrics[RATIO_TRUNCATED]) <= 1.0


def test_zero_rollout_probability_and_neg_inf_trainer_entries_stay_finite():
    mask = SamplingMask.from_lists([[0, 1, 2]], sampled=torch.tensor([0]))
    z = torch.tensor([[1.0, -INF, 0.5]], dtype=torch.float64, requires_grad=True)
    lp = mr.replay_support_logprobs(z, mask)
    lq = torch.tensor([math.log(0.5), math.log(0.5), -INF], dtype=torch.float64)
    loss, metrics = mr.score_centered_pg(lp, lq, mask, 1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(z.grad).all()
    assert torch.isfinite(metrics[COEFFICIENT_L1])


def test_errors_name_the_problem():
    mask, _, lq, _, adv = case(seed=4)
    lp = lq.clone()
    with pytest.raises(ValueError, match=r"trainer_logprobs must be a floating tensor \[nnz\]"):
        mr.score_centered_pg(lp[:-1], lq, mask, adv)
    with pytest.raises(ValueError, match="cap must be a number > 0"):
        mr.score_centered_pg(lp, lq, mask, adv, cap=0)
    with pytest.raises(ValueError, match="advantages must be a scalar or"):
        mr.score_centered_pg(lp, lq, mask, adv[:2])
    y = mask.sampled.clone()
    y[2] = 11 if 11 not in mask.row(2).tolist() else 10
    with pytest.raises(ValueError, match="is not in the support of row 2"):
        mr.score_centered_pg(lp, lq, mask, adv, sampled=y)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 6), seed=st.integers(0, 10_000), cap=st.sampled_from([0.5, 1.0, 2.0, 10.0]),
       spread=st.sampled_from([0.1, 1.0, 4.0]))
def test_centering_holds_for_random_p_q_and_cap(k, seed, cap, spread):
    """E_{y ~ q}[d loss / d lp] = 0 exactly, for any p, q over S and any cap (by enumeration of y)."""
    g = torch.Generator().manual_seed(seed)
    mask = SamplingMask.from_lists([list(range(k))])
    lq = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * spread, 0)
    lp0 = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * spread, 0)
    total = torch.zeros(k, dtype=torch.float64)
    for y in range(k):
        lp = lp0.clone().requires_grad_()
        loss, _ = mr.score_centered_pg(lp, lq, mask, 1.0, sampled=torch.tensor([y]), cap=cap)
        (g_lp,) = torch.autograd.grad(loss.sum(), lp)
        total += lq[y].exp() * g_lp
    assert torch.allclose(total, torch.zeros(k, dtype=torch.float64), atol=1e-12)


# ---- issue 30: empty rows, NaN / +inf log-probs, a sampled entry with q_y = 0 -------------------------
def row_loss_ref(lp, lq, rows, sampled, adv, cap):
    """An independent float64 reference, row by row in Python numbers: (loss [N] as a function of lp
    with the weights held, mask of rows with a support, truncated [N]). Ratios are p / q in linear
    space; q = 0 gives +inf where p > 0 and 0 where p = 0; empty rows are 0 and outside the metrics."""
    losses, kept, truncated = [], [], []
    e = 0
    for i, ids in enumerate(rows):
        k = len(ids)
        if k == 0:
            losses.append(lp.new_zeros(()))
            kept.append(False)
            truncated.append(0.0)
            continue
        total, over = lp.new_zeros(()), 0.0
        for j in range(k):
            p, q = math.exp(float(lp[e + j].detach())), math.exp(float(lq[e + j]))
            ratio = p / q if q > 0 else (math.inf if p > 0 else 0.0)
            w = min(ratio, cap)
            if ids[j] == sampled[i]:
                # p / q > C read as log p - log q > log C: exp rounds a log-ratio of 1e-34 to a ratio of
                # exactly 1, which at C = 1 would call the boundary the other way (a hypothesis find)
                log_ratio = (float(lp[e + j].detach()) - float(lq[e + j]) if q > 0
                             else math.inf if p > 0 else -math.inf)
                over = 1.0 if log_ratio > math.log(cap) else 0.0
                if p > 0:
                    total = total + w * lp[e + j]
            if q > 0 and p > 0:
                total = total - q * w * lp[e + j]
        losses.append(-float(adv[i]) * total)
        kept.append(True)
        truncated.append(over)
        e += k
    return torch.stack(losses), torch.tensor(kept), torch.tensor(truncated, dtype=torch.float64)


def test_an_empty_row_is_a_forced_token_with_zero_loss_and_no_gradient():
    rows = [[1, 3, 4], [], [0, 2]]
    mask = SamplingMask.from_lists(rows, sampled=torch.tensor([3, 5, 0]))
    lq = torch.log(torch.tensor([0.2, 0.5, 0.3, 0.2, 0.8], dtype=torch.float64))
    lp = torch.log(torch.tensor([0.5, 0.25, 0.25, 0.9, 0.1], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.5, 2.0, -0.5], dtype=torch.float64)
    loss, metrics = mr.score_centered_pg(lp, lq, mask, adv)
    want, kept, trunc = row_loss_ref(lp, lq, rows, [3, 5, 0], adv, 2.0)
    assert torch.allclose(loss, want, atol=1e-12) and loss[1] == 0
    (g,) = torch.autograd.grad(loss.sum(), lp)
    (g_ref,) = torch.autograd.grad(want.sum(), lp)
    assert torch.allclose(g, g_ref, atol=1e-12)
    # the metrics average over the two rows that have a support
    assert metrics[RATIO_TRUNCATED].item() == pytest.approx(trunc[kept].mean().item())
    assert metrics[RATIO_TRUNCATED].item() == pytest.approx(0.5)  # row 0: 0.25 / 0.5 < 2; row 2: 0.9 / 0.2 > 2
    assert metrics[COEFFICIENT_L1].item() < 1.0 + 1e-12


def test_all_rows_empty_gives_zero_loss_and_zero_metrics():
    mask = SamplingMask.from_lists([[], []], sampled=torch.tensor([1, 2]))
    empty = torch.zeros(0, dtype=torch.float64)
    loss, metrics = mr.score_centered_pg(empty, empty, mask, 1.0)
    assert loss.tolist() == [0.0, 0.0]
    assert metrics[COEFFICIENT_L1].item() == 0.0 and metrics[RATIO_TRUNCATED].item() == 0.0


@pytest.mark.parametrize("side", ["trainer_logprobs", "rollout_logprobs"])
@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_nan_or_pos_inf_log_probs_of_a_non_sampled_entry_are_refused_naming_the_row(side, bad):
    mask = SamplingMask.from_lists([[0, 1], [2, 5, 7]], sampled=torch.tensor([0, 2]))
    lq = torch.log(torch.tensor([0.5, 0.5, 0.2, 0.3, 0.5], dtype=torch.float64))
    lp = lq.clone()
    (lp if side == "trainer_logprobs" else lq)[4] = bad  # row 1, token 7: not the sampled one
    with pytest.raises(mr.errors.InputError, match=rf"{side} has {bad} at row 1 \(token 7, entry 4\)"):
        mr.score_centered_pg(lp, lq, mask, 1.0)


@pytest.mark.parametrize("cap", [2.0, 5.0])
def test_a_sampled_entry_with_rollout_probability_zero_has_weight_cap_and_counts_as_truncated(cap):
    rows = [[0, 1, 2], [3, 4]]
    mask = SamplingMask.from_lists(rows, sampled=torch.tensor([2, 3]))
    lq = torch.tensor([math.log(0.5), math.log(0.5), -INF, math.log(0.9), math.log(0.1)], dtype=torch.float64)
    lp = torch.log(torch.tensor([0.3, 0.3, 0.4, 0.8, 0.2], dtype=torch.float64)).requires_grad_()
    loss, metrics = mr.score_centered_pg(lp, lq, mask, 1.0, cap=cap)
    w_y, _, truncated = centering_weights(lp.detach(), lq, mask.row_ids(), torch.tensor(
        [False, False, True, True, False]), 2, cap)
    assert w_y[0].item() == cap and truncated.tolist() == [1.0, 0.0]  # weight and count agree
    want, _, trunc = row_loss_ref(lp, lq, rows, [2, 3], torch.ones(2, dtype=torch.float64), cap)
    assert torch.allclose(loss, want, atol=1e-12)
    assert metrics[RATIO_TRUNCATED].item() == pytest.approx(trunc.mean().item()) == pytest.approx(0.5)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    (g_ref,) = torch.autograd.grad(want.sum(), lp)
    assert torch.allclose(g, g_ref, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), cap=st.sampled_from([0.5, 1.0, 2.0, 10.0]))
def test_matches_the_row_by_row_reference_with_empty_rows_and_zero_probabilities(data, n, cap):
    rows, sampled = [], []
    for _ in range(n):
        ids = sorted(data.draw(st.sets(st.integers(0, 9), max_size=5)))
        rows.append(ids)
        sampled.append(data.draw(st.sampled_from(ids)) if ids else data.draw(st.integers(0, 9)))
    mask = SamplingMask.from_lists(rows, sampled=torch.tensor(sampled))
    nnz = mask.nnz

    def logprobs(name):
        raw = torch.tensor(data.draw(st.lists(st.floats(-3, 3), min_size=nnz, max_size=nnz), label=name),
                           dtype=torch.float64)
        zero = torch.tensor(data.draw(st.lists(st.booleans(), min_size=nnz, max_size=nnz), label=name + "0"),
                            dtype=torch.bool)
        return torch.where(zero, torch.full_like(raw, -INF), raw)

    lp, lq = logprobs("lp").requires_grad_(), logprobs("lq")
    adv = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n)), dtype=torch.float64)
    loss, metrics = mr.score_centered_pg(lp, lq, mask, adv, cap=cap)
    want, kept, trunc = row_loss_ref(lp, lq, rows, sampled, adv, cap)
    assert torch.allclose(loss, want, atol=1e-10)
    assert torch.isfinite(loss).all()
    want_trunc = trunc[kept].mean().item() if bool(kept.any()) else 0.0
    assert metrics[RATIO_TRUNCATED].item() == pytest.approx(want_trunc)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    g_ref = torch.autograd.grad(want.sum(), lp, allow_unused=True)[0] if want.requires_grad else None
    assert torch.allclose(g, torch.zeros_like(g) if g_ref is None else g_ref, atol=1e-10)


# ---- torch.compile (issue 30: the support check stopped the trace on a data-dependent guard) ------------
def _compile_case():
    mask, z_train, lq, _, adv = case(seed=5, n=5, v=11)
    mask = SamplingMask.concat([mask, SamplingMask.from_lists([[]], sampled=torch.tensor([3]))])  # + an empty row
    adv = torch.cat([adv, torch.ones(1, dtype=torch.float64)])
    z = torch.cat([z_train, torch.randn(1, z_train.shape[1], dtype=torch.float64)])

    def f(logits, lq):
        loss, metrics = mr.score_centered_pg(mr.replay_support_logprobs(logits, mask, temperature=0.9), lq, mask,
                                             adv, cap=1.5)
        return torch.cat([loss, metrics[COEFFICIENT_L1][None], metrics[RATIO_TRUNCATED][None]])

    return f, z, lq


def _check_compiled(backend):
    f, z, lq = _compile_case()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(z, lq), f(z, lq))
    (got,), (want,) = grads(lambda x: compiled(x, lq), z), grads(lambda x: f(x, lq), z)
    torch.testing.assert_close(got, want)
    # the host-side NaN check is not run when traced: the bad row's loss is NaN, the others unchanged
    bad = lq.clone()
    bad[-1] = float("nan")
    out = compiled(z, bad)
    assert torch.isnan(out[4]) and torch.equal(out[:4], f(z, lq)[:4])


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_score_centered_pg_traces_fullgraph_and_matches_eager(backend):
    _check_compiled(backend)


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
def test_score_centered_pg_with_labels_and_loss_mask_traces_fullgraph():
    """The batch layout ([B, T] labels with ignored positions, a loss mask) traces too: the kept
    positions are found with a static size (the mask's row count)."""
    mask, z_train, lq, _, adv = case(seed=6, n=5, v=11)
    labels = torch.full((2, 4), -100, dtype=torch.int64)
    labels.view(-1)[torch.tensor([0, 2, 3, 5, 6, 7])] = mask.sampled.new_zeros(6) + 1  # 6 not ignored
    loss_mask = torch.ones(2, 4, dtype=torch.int64)
    loss_mask[1, 3] = 0  # 5 kept positions = the mask's 5 rows
    adv_b = torch.arange(8, dtype=torch.float64).reshape(2, 4) / 4

    def f(logits, lq):
        loss, metrics = mr.score_centered_pg(mr.replay_support_logprobs(logits, mask, temperature=0.9), lq, mask,
                                             adv_b, cap=1.5, labels=labels, loss_mask=loss_mask)
        return torch.cat([loss.reshape(-1), metrics[COEFFICIENT_L1][None], metrics[RATIO_TRUNCATED][None]])

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want = f(z_train, lq)
    torch.testing.assert_close(compiled(z_train, lq), want)
    # the kept positions in order, the ignored ones 0
    kept = torch.tensor([0, 2, 3, 5, 6])
    rows, _ = mr.score_centered_pg(mr.replay_support_logprobs(z_train, mask, temperature=0.9), lq, mask,
                                   adv_b.reshape(-1)[kept], cap=1.5)
    assert torch.equal(want[:8][kept], rows) and not want[:8][[1, 4, 7]].any()
    (got,), (ref,) = grads(lambda x: compiled(x, lq), z_train), grads(lambda x: f(x, lq), z_train)
    torch.testing.assert_close(got, ref)


@pytest.mark.slow
def test_score_centered_pg_compiles_with_inductor():
    _check_compiled("inductor")
