"""support_entropy / support_kl and their LM-head variants against a dense reference
(mask.to_dense + masked log_softmax), values and gradients, edge cases and random shapes."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from tests.helpers import DEVICES

INF = float("inf")


# ---- the dense reference -------------------------------------------------------------------------
def _dense_logq(logits, dense_mask, temperature):
    t = torch.as_tensor(temperature, dtype=torch.float64, device=logits.device).reshape(-1, 1)
    x = (logits.double() / t).masked_fill(~dense_mask, -INF)
    has = torch.isfinite(x).any(1, keepdim=True)  # a row with a distribution at all
    logq = torch.log_softmax(torch.where(has, x, torch.zeros_like(x)), dim=1)
    on = dense_mask & has & (x > -INF)  # tokens with q > 0
    # log q = -inf off those tokens; a 0 stand-in keeps where() from back-propagating 0 * inf
    return torch.where(on, logq, torch.zeros_like(logq)), on


def entropy_ref(logits, dense_mask, temperature=1.0):
    logq, on = _dense_logq(logits, dense_mask, temperature)
    return -torch.where(on, logq.exp() * logq, torch.zeros_like(logq)).sum(1)


def kl_ref(logits_p, logits_q, dense_mask, temperature=1.0):
    logp, on_p = _dense_logq(logits_p, dense_mask, temperature)
    logq, on_q = _dense_logq(logits_q, dense_mask, temperature)
    kl = torch.where(on_p, logp.exp() * (logp - logq), torch.zeros_like(logp)).sum(1)
    return torch.where((on_p & ~on_q).any(1), torch.full_like(kl, INF), kl)


def make(n, v, *, seed=0, max_k=5, empty=0.2, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        if torch.rand((), generator=g) < empty:
            rows.append([])
        else:
            k = int(torch.randint(1, min(max_k, v) + 1, (), generator=g))
            rows.append(torch.randperm(v, generator=g)[:k].tolist())
    logits_p = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).to(device)
    logits_q = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).to(device)
    temp = (0.5 + torch.rand(n, generator=g)).to(device)
    return logits_p, logits_q, mr.SamplingMask.from_lists(rows).to(device), temp


def grads_of(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    return torch.autograd.grad((out * w).sum(), leaves)


# ---- values and gradients --------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_entropy_and_kl_match_reference_fp64(device):
    zp, zq, mask, t = make(30, 17, seed=1, device=device)
    dm = mask.to_dense(17)
    torch.testing.assert_close(mr.support_entropy(zp, mask, t), entropy_ref(zp, dm, t), rtol=0, atol=1e-12)
    torch.testing.assert_close(mr.support_kl(zp, zq, mask, t), kl_ref(zp, zq, dm, t), rtol=0, atol=1e-12)
    g = grads_of(lambda a: mr.support_entropy(a, mask, t), zp)[0]
    gr = grads_of(lambda a: entropy_ref(a, dm, t), zp)[0]
    torch.testing.assert_close(g, gr, rtol=0, atol=1e-12)
    assert (g[~dm] == 0).all()
    gk = grads_of(lambda a, b: mr.support_kl(a, b, mask, t), zp, zq)
    gkr = grads_of(lambda a, b: kl_ref(a, b, dm, t), zp, zq)
    for a, b in zip(gk, gkr):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_gradcheck_fp64():
    zp, zq, mask, t = make(6, 9, seed=2)
    a = zp.clone().requires_grad_(True)
    b = zq.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: mr.support_entropy(a, mask, t), (a,))
    assert torch.autograd.gradcheck(lambda a, b: mr.support_kl(a, b, mask, t), (a, b))


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
def test_gradcheck_from_hidden_fp64():
    """The dense-gradient head under gradcheck; the sparse one is compared with it below."""
    _, _, mask, t = make(5, 11, seed=3)
    g = torch.Generator().manual_seed(3)
    h, hq = (torch.randn(5, 4, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    w, wq = (torch.randn(11, 4, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    b = torch.randn(11, generator=g, dtype=torch.float64).requires_grad_(True)
    ent = lambda h, w, b: mr.support_entropy_from_hidden(h, w, mask, t, b)  # noqa: E731
    assert torch.autograd.gradcheck(ent, (h, w, b))
    kl = lambda h, w, hq, wq: mr.support_kl_from_hidden(h, w, hq, wq, mask, t)  # noqa: E731
    assert torch.autograd.gradcheck(kl, (h, w, hq, wq))


@pytest.mark.parametrize("device", DEVICES)
def test_from_hidden_matches_logits_path_and_dense_gradients(device):
    _, _, mask, t = make(12, 40, seed=4, device=device)
    g = torch.Generator().manual_seed(4)
    h, hq = (torch.randn(12, 8, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    w, wq = (torch.randn(40, 8, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    b = torch.randn(40, generator=g, dtype=torch.float64).to(device)
    dm = mask.to_dense(40)
    got = mr.support_entropy_from_hidden(h, w, mask, t, b)
    torch.testing.assert_close(got, entropy_ref(h @ w.T + b, dm, t), rtol=0, atol=1e-12)
    got_kl = mr.support_kl_from_hidden(h, w, hq, wq, mask, t)
    torch.testing.assert_close(got_kl, kl_ref(h @ w.T, hq @ wq.T, dm, t), rtol=0, atol=1e-12)
    dense_g = grads_of(lambda h, w, b: entropy_ref(h @ w.T + b, dm, t), h, w, b)
    for sparse_grad in (False, True):
        ours = grads_of(lambda h, w, b: mr.support_entropy_from_hidden(h, w, mask, t, b, sparse_grad=sparse_grad),
                        h, w, b)
        assert ours[1].is_sparse == sparse_grad
        for a, r in zip(ours, dense_g):
            torch.testing.assert_close(a.to_dense() if a.is_sparse else a, r, rtol=0, atol=1e-12)
    kl_dense = grads_of(lambda h, w, hq, wq: kl_ref(h @ w.T, hq @ wq.T, dm, t), h, w, hq, wq)
    kl_ours = grads_of(lambda h, w, hq, wq: mr.support_kl_from_hidden(h, w, hq, wq, mask, t, sparse_grad=True),
                       h, w, hq, wq)
    for a, r in zip(kl_ours, kl_dense):
        torch.testing.assert_close(a.to_dense() if a.is_sparse else a, r, rtol=0, atol=1e-12)


# ---- edge cases ------------------------------------------------------------------------------------
def test_empty_rows_and_singletons_are_zero_with_zero_gradient():
    z = torch.randn(3, 6, dtype=torch.float64)
    mask = mr.SamplingMask.from_lists([[], [4], [1, 2]])
    h = mr.support_entropy(z, mask)
    k = mr.support_kl(z, z * 3 + 1, mask)
    assert h[:2].tolist() == [0.0, 0.0] and k[:2].tolist() == [0.0, 0.0]
    assert h[2] > 0 and k[2] > 0
    (g,) = grads_of(lambda a: mr.support_entropy(a, mask), z)
    assert (g[:2] == 0).all()
    (g,) = grads_of(lambda a: mr.support_kl(a, z, mask), z)
    assert (g[:2] == 0).all()


def test_neg_inf_logits_inside_the_support():
    z = torch.randn(4, 6, dtype=torch.float64)
    zq = torch.randn(4, 6, dtype=torch.float64)
    z[0, 1] = -INF           # one -inf token inside K: probability 0, adds 0
    z[1, [0, 2]] = -INF      # every token of K is -inf: no distribution, 0
    zq[2, 3] = -INF          # reference gives 0 to a token the policy keeps: KL = +inf
    z[3, 5] = -INF
    zq[3, 5] = -INF          # both give it 0: finite
    mask = mr.SamplingMask.from_lists([[1, 3, 4], [0, 2], [3, 4], [0, 5]])
    dm = mask.to_dense(6)
    h = mr.support_entropy(z, mask)
    torch.testing.assert_close(h, entropy_ref(z, dm), rtol=0, atol=1e-12)
    assert torch.isfinite(h).all() and h[1] == 0
    torch.testing.assert_close(h[0], entropy_ref(z[:1, [3, 4]], torch.ones(1, 2, dtype=torch.bool))[0])
    k = mr.support_kl(z, zq, mask)
    torch.testing.assert_close(k, kl_ref(z, zq, dm), rtol=0, atol=1e-12)
    assert k[2] == INF and torch.isfinite(k[[0, 1, 3]]).all()
    (g,) = grads_of(lambda a: mr.support_entropy(a, mask), z)
    assert torch.isfinite(g).all() and (g[1] == 0).all()
    gk = grads_of(lambda a, b: mr.support_kl(a, b, mask)[[0, 1, 3]], z, zq)
    assert all(torch.isfinite(x).all() for x in gk)


def test_nan_logit_in_support_gives_nan():
    z = torch.randn(2, 5)
    z[0, 2] = float("nan")
    mask = mr.SamplingMask.from_lists([[1, 2], [3]])
    h = mr.support_entropy(z, mask)
    assert torch.isnan(h[0]) and h[1] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_fp32(dtype):
    zp, zq, mask, t = make(64, 300, seed=5, max_k=40, empty=0.0)
    zp, zq = zp.to(dtype), zq.to(dtype)
    dm = mask.to_dense(300)
    truth_h, truth_k = entropy_ref(zp, dm, t), kl_ref(zp, zq, dm, t)
    h = mr.support_entropy(zp, mask, t)
    k = mr.support_kl(zp, zq, mask, t)
    assert h.dtype == torch.float32 and k.dtype == torch.float32
    assert (h.double() - truth_h).abs().max() < 1e-5
    assert (k.double() - truth_k).abs().max() < 1e-5
    own = mr.support_entropy(zp, mask, t, out_dtype=dtype)
    assert own.dtype == dtype
    torch.testing.assert_close(own, h.to(dtype), rtol=0, atol=0)
    (g,) = grads_of(lambda a: mr.support_entropy(a, mask, t), zp)
    assert g.dtype == dtype and torch.isfinite(g.float()).all()


def test_bt_layout_with_loss_mask():
    b, t, v = 2, 4, 9
    g = torch.Generator().manual_seed(6)
    full = torch.randn(b, t + 1, v, generator=g, dtype=torch.float64)
    zp, zq = full[:, :-1], torch.randn(b, t, v, generator=g, dtype=torch.float64)
    loss_mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    mask = mr.SamplingMask.from_lists([[1, 2], [3, 4, 5], [0], [6, 8], [2, 7]])
    h = mr.support_entropy(zp, mask, loss_mask=loss_mask)
    assert h.shape == (b, t) and (h[~loss_mask] == 0).all()
    torch.testing.assert_close(h[loss_mask], entropy_ref(zp[loss_mask], mask.to_dense(v)), rtol=0, atol=1e-12)
    k = mr.support_kl(zp, zq, mask, loss_mask=loss_mask)
    torch.testing.assert_close(k[loss_mask], kl_ref(zp[loss_mask], zq[loss_mask], mask.to_dense(v)),
                               rtol=0, atol=1e-12)
    f = full.clone().requires_grad_(True)
    mr.support_entropy(f[:, :-1], mask, loss_mask=loss_mask).sum().backward()
    assert (f.grad[:, -1] == 0).all() and (f.grad[:, :-1][~loss_mask] == 0).all()


def test_bad_input_names_the_problem():
    z = torch.randn(3, 6)
    mask = mr.SamplingMask.from_lists([[1], [2], [3]])
    with pytest.raises(ValueError, match="the mask has 3 rows but there are 2 rows of logits"):
        mr.support_entropy(z[:2], mask)
    bad = mr.SamplingMask(torch.tensor([1, 9, 2], dtype=torch.int32), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"token_ids of row 1 hold an id outside \[0, 6\)"):
        mr.support_entropy(z, bad)
    unsorted = mr.SamplingMask(torch.tensor([1, 3, 2], dtype=torch.int32), torch.tensor([0, 1, 3, 3]))
    with pytest.raises(ValueError, match="token_ids of row 1 are not strictly ascending"):
        mr.support_kl(z, z, unsorted)
    with pytest.raises(ValueError, match="temperature must be finite and > 0, row 2"):
        mr.support_entropy(z, mask, torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="logits_p .* and logits_q .* must have one shape"):
        mr.support_kl(z, z[:, :5], mask)
    with pytest.raises(ValueError, match="need loss_mask"):
        mr.support_entropy(z[None], mask)
    with pytest.raises(ValueError, match="weight has d = 3 but hidden has d = 4"):
        mr.support_entropy_from_hidden(torch.randn(3, 4), torch.randn(6, 3), mask)


@given(n=st.integers(0, 8), v=st.integers(1, 12), seed=st.integers(0, 2**16), max_k=st.integers(1, 12),
       empty=st.sampled_from([0.0, 0.3, 1.0]))
def test_hypothesis_shapes(n, v, seed, max_k, empty):
    zp, zq, mask, t = make(n, v, seed=seed, max_k=max_k, empty=empty)
    dm = mask.to_dense(v)
    torch.testing.assert_close(mr.support_entropy(zp, mask, t), entropy_ref(zp, dm, t), rtol=0, atol=1e-12)
    torch.testing.assert_close(mr.support_kl(zp, zq, mask, t), kl_ref(zp, zq, dm, t), rtol=0, atol=1e-12)
    if n:
        got = grads_of(lambda a, b: mr.support_kl(a, b, mask, t), zp, zq)
        want = grads_of(lambda a, b: kl_ref(a, b, dm, t), zp, zq)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
