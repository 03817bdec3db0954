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
