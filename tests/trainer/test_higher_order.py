"""Derivatives the ops do not define are refused by name, never answered with a silent zero.

The ops have first-order reverse-mode gradients only. Double backward (a Hessian-vector product after
create_graph=True) and forward-mode AD must raise an error naming the op; the first-order gradient
itself must be unchanged under create_graph=True.
"""
import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import mask_replay as mr
from tests.helpers import replay_ref

N, V, D = 4, 7, 5


def _case():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, dtype=torch.float64, generator=g)
    mask = mr.capture(logits.float(), top_k=4)
    sampled = logits.argmax(1)
    return logits, mask, sampled


def _head_case():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, D, dtype=torch.float64, generator=g)
    weight = torch.randn(V, D, dtype=torch.float64, generator=g)
    mask = mr.capture((hidden @ weight.T).float(), top_k=4)
    return hidden, weight, mask, (hidden @ weight.T).argmax(1)


def _logit_fns():
    logits, mask, sampled = _case()
    return logits, {
        "replay_2d": ("replay_fwd", lambda x: mr.replay_logprobs(x, mask, sampled)),
        "replay_btv": ("replay_fwd", lambda x: mr.replay_logprobs(x.view(2, 2, V), mask, sampled.view(2, 2))),
        "replay_packed": ("replay_fwd", lambda x: mr.replay_logprobs(x, mask, sampled,
                                                                      cu_seqlens=torch.tensor([0, 1, 4]))),
        "full": ("full_fwd", lambda x: mr.full_logprobs(x, sampled)),
    }


def _head_fns():
    hidden, weight, mask, sampled = _head_case()
    return hidden, weight, {
        "hidden_dense": ("hidden_fwd", lambda h, w: mr.replay_logprobs_from_hidden(h, w, mask, sampled)),
        "hidden_sparse": ("sparse LM head", lambda h, w: mr.replay_logprobs_from_hidden(h, w, mask, sampled,
                                                                                          sparse_grad=True)),
        "entropy_hidden": ("sparse LM head", lambda h, w: mr.support_entropy_from_hidden(h, w, mask)),
    }


LOGIT_CASES = list(_logit_fns()[1])
HEAD_CASES = list(_head_fns()[2])


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_double_backward_is_refused_by_name(case):
    logits, fns = _logit_fns()
    op, fn = fns[case]
    x = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{op}.*double backward"):
        torch.autograd.grad((g * g).sum(), x, allow_unused=True)


@pytest.mark.parametrize("case", HEAD_CASES)
def test_double_backward_of_the_head_is_refused_by_name(case):
    hidden, weight, fns = _head_fns()
    op, fn = fns[case]
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(h, w).sum(), h, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{op}.*double backward"):
        torch.autograd.grad((g * g).sum(), (h, w), allow_unused=True)


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_forward_ad_is_refused_by_name(case):
    logits, fns = _logit_fns()
    op, fn = fns[case]
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match=f"{op}.*forward-mode AD"):
        fn(forward_ad.make_dual(logits, torch.ones_like(logits)))
    with pytest.raises(NotImplementedError, match=f"{op}.*forward-mode AD"):
        torch.func.jvp(fn, (logits,), (torch.ones_like(logits),))


@pytest.mark.parametrize("case", HEAD_CASES)
def test_forward_ad_of_the_head_is_refused_by_name(case):
    hidden, weight, fns = _head_fns()
    op, fn = fns[case]
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        fn(forward_ad.make_dual(hidden, torch.ones_like(hidden)), weight)


@pytest.mark.parametrize("case", LOGIT_CASES[:3])
def test_first_order_gradient_is_unchanged_under_create_graph(case):
    logits, mask, sampled = _case()
    _, fns = _logit_fns()
    fn = fns[case][1]
    x = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    dense = torch.zeros(N, V, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(N), mask.offsets[1:] - mask.offsets[:-1])
    dense[rows, mask.token_ids.long()] = True
    r = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(replay_ref(r, dense, sampled).sum(), r)
    torch.testing.assert_close(g.detach(), expected)
