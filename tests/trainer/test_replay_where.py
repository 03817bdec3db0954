"""replay_where (trainer/replay_where.py) against a float64 PyTorch reference: replay over the support on
kept rows, the trainer's own value passed through bit for bit elsewhere, and gradients equal to
autograd through ``torch.where(keep, log_softmax over K, log_softmax over V)``."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mask_replay.errors import InputError, MaskFormatError
from mask_replay.mask import SamplingMask
from mask_replay.trainer.replay_where import replay_where
from tests.helpers import DEVICES, full_ref, replay_ref


def case(n, v, seed, p_keep=0.6, density=0.3):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, v, generator=g)
    sampled = torch.randint(0, v, (n,), generator=g)
    keep = torch.rand(n, generator=g) < p_keep
    dense = (torch.rand(n, v, generator=g) < density) & keep[:, None]
    dense[torch.arange(n), sampled] |= keep
    rows = [torch.nonzero(dense[r]).flatten() for r in range(n) if keep[r]]
    ids = torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32)
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    return logits, sampled, keep, dense, SamplingMask(ids, offsets)


def reference(logits, dense, sampled, keep, t):
    # float64, dense, autograd: the support's log-softmax on kept rows, the full one elsewhere
    return torch.where(keep, replay_ref(logits, dense, sampled, t), full_ref(logits, sampled, t))


def own_logprobs(logits, sampled, t, dtype=torch.float32):
    """What a trainer computes itself: log_softmax over the vocabulary, no graph."""
    with torch.no_grad():
        return torch.log_softmax(logits.to(dtype) / t, -1).gather(1, sampled[:, None])[:, 0]


def weighted_grad(fn, logits, weight_dtype=torch.float64):
    # weight_dtype: a bfloat16 result's incoming gradient is bfloat16; the reference gets the same weights
    leaf = logits.detach().clone().requires_grad_(True)
    out = fn(leaf)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64).to(weight_dtype).double()
    (out.to(torch.float64) * w).sum().backward()
    return out.detach(), leaf.grad


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 12), v=st.integers(1, 50), seed=st.integers(0, 2**31 - 1),
       p_keep=st.sampled_from([0.0, 0.5, 1.0]), t=st.sampled_from([1.0, 0.7]))
def test_matches_the_reference(n, v, seed, p_keep, t):
    logits, sampled, keep, dense, mask = case(n, v, seed, p_keep)
    own = own_logprobs(logits, sampled, t)
    got, g = weighted_grad(lambda x: replay_where(keep, x, mask, sampled, own, t), logits)
    want, g_ref = weighted_grad(lambda x: reference(x.to(torch.float64), dense, sampled, keep, t), logits)
    assert got.dtype == own.dtype
    assert torch.equal(got[~keep], own[~keep])  # the trainer's own value, bit for bit
    torch.testing.assert_close(got[keep].double(), want[keep], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g.double(), g_ref.double(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("own_dtype", [torch.float64, torch.bfloat16])
def test_own_dtypes(device, own_dtype):
    # float64: logsumexp implied by own; bfloat16 (too coarse to imply it): recomputed by the kernel
    logits, sampled, keep, dense, mask = case(10, 30, 3)
    logits = logits.double() if own_dtype == torch.float64 else logits
    own = own_logprobs(logits, sampled, 1.0, own_dtype)
    got, g = weighted_grad(lambda x: replay_where(keep.to(device), x.to(device), mask.to(device), sampled.to(device),
                                                  own.to(device)), logits)
    _, g_ref = weighted_grad(lambda x: reference(x.to(torch.float64), dense, sampled, keep, 1.0), logits, own_dtype)
    assert got.dtype == own_dtype and torch.equal(got[~keep].cpu(), own[~keep])
    torch.testing.assert_close(g.double(), g_ref.double(), atol=1e-6 if own_dtype == torch.float64 else 2e-5, rtol=1e-5)


def test_a_row_whose_own_value_is_not_finite_gets_a_zero_gradient():
    logits, sampled, keep, dense, mask = case(6, 12, 5, p_keep=0.5)
    r = int(torch.nonzero(~keep)[0])
    own = own_logprobs(logits, sampled, 1.0)
    own[r] = float("-inf")
    got, g = weighted_grad(lambda x: replay_where(keep, x, mask, sampled, own), logits)
    assert got[r] == float("-inf") and torch.all(g[r] == 0) and torch.isfinite(g).all()


def test_no_double_backward():
    logits, sampled, keep, _, mask = case(5, 9, 2)
    x = logits.clone().requires_grad_(True)
    out = replay_where(keep, x, mask, sampled, own_logprobs(logits, sampled, 1.0))
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("change, problem", [
    (lambda a: a.update(keep=a["keep"].long()), "keep must be a bool tensor"),
    (lambda a: a.update(own=a["own"][:-1]), r"own must have shape \[6\]"),
    (lambda a: a.update(sampled=a["sampled"].float()), "integer token ids"),
    (lambda a: a.update(logits=a["logits"][0]), r"logits must be \[N, V\]"),
    (lambda a: a.update(mask=SamplingMask(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))),
     "the mask has 0 rows but keep marks"),
    (lambda a: a.update(mask=SamplingMask(a["mask"].token_ids, a["mask"].offsets.flip(0))), "offsets"),
])
def test_bad_input_is_named(change, problem):
    logits, sampled, keep, _, mask = case(6, 12, 7, p_keep=1.0)
    args = dict(keep=keep, logits=logits, mask=mask, sampled=sampled, own=own_logprobs(logits, sampled, 1.0))
    change(args)
    with pytest.raises((InputError, MaskFormatError), match=problem):
        replay_where(args["keep"], args["logits"], args["mask"], args["sampled"], args["own"])


@pytest.mark.parametrize("own_dtype", [torch.float32, torch.bfloat16])
def test_a_kept_row_without_its_sampled_token_is_named(own_dtype):
    # in both modes: the bfloat16 one runs the kernel with fallback on for the unkept rows, never the kept
    logits, sampled, keep, _, mask = case(6, 12, 11, p_keep=1.0, density=0.0)  # rows = the sampled token alone
    other = sampled.clone()
    other[2] = (sampled[2] + 1) % 12
    with pytest.raises((InputError, RuntimeError), match="row 2"):  # the kernel's own error, or ours
        replay_where(keep, logits, mask, other, own_logprobs(logits, other, 1.0, own_dtype))
