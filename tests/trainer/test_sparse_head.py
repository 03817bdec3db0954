"""replay_logprobs_from_hidden(sparse_grad=True): a sparse COO weight gradient equal to the dense
path's, accumulated in place into an existing dense weight.grad."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from mask_replay.trainer.replay import FELL_BACK_EMPTY, FELL_BACK_OUTSIDE
from tests.helpers import DEVICES, hidden_ref


def make(n, v, d, *, seed=0, max_k=5, outside=(), empty=(), dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rows, ys = [], []
    for i in range(n):
        k = int(torch.randint(1, min(max_k, v) + 1, (), generator=g))
        ids = torch.randperm(v, generator=g)[:k].tolist()
        y = ids[int(torch.randint(k, (), generator=g))]
        if i in outside and k < v:
            y = next(j for j in range(v) if j not in ids)
        if i in empty:
            ids = []
        rows.append(ids)
        ys.append(y)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    temp = (0.5 + torch.rand(n, generator=g)).to(device)
    y = torch.tensor(ys, dtype=torch.int64, device=device)
    return h, w, b, mr.SamplingMask.from_lists(rows).to(device), y, temp


def run(h, w, b, mask, y, t, *, sparse_grad, fallback=False):
    """Value, status and gradients (hidden, weight, bias) of a weighted sum of the output."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
    lp, status = mr.replay_logprobs_from_hidden(leaves[0], leaves[1], mask, y, t, leaves[2], fallback=fallback,
                                                return_status=True, sparse_grad=sparse_grad)
    wts = torch.linspace(0.5, 1.5, lp.numel(), dtype=lp.dtype, device=lp.device)
    grads = torch.autograd.grad((lp * wts).sum(), leaves)
    return lp, status, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fallback_rows", [False, True])
def test_sparse_matches_dense_path_fp64(device, fallback_rows):
    kw = dict(outside=(1, 5), empty=(3,)) if fallback_rows else {}
    h, w, b, mask, y, t = make(9, 30, 6, seed=1, device=device, **kw)
    lp_s, st_s, (gh_s, gw_s, gb_s) = run(h, w, b, mask, y, t, sparse_grad=True, fallback=True)
    lp_d, st_d, (gh_d, gw_d, gb_d) = run(h, w, b, mask, y, t, sparse_grad=False, fallback=True)
    torch.testing.assert_close(lp_s, lp_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(lp_s, hidden_ref(h, w, b, mask.to_dense(30), y, t, fallback=True), rtol=0, atol=1e-12)
    assert st_s.tolist() == st_d.tolist()
    if fallback_rows:
        assert st_s.tolist().count(FELL_BACK_OUTSIDE) == 2 and st_s[3] == FELL_BACK_EMPTY
    assert gw_s.layout == torch.sparse_coo and gw_d.layout == torch.strided
    torch.testing.assert_close(gw_s.to_dense(), gw_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(gh_s, gh_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(gb_s, gb_d, rtol=0, atol=1e-12)


def test_sparse_gradient_holds_only_the_support_rows():
    h, w, b, mask, y, t = make(16, 200, 8, seed=2)
    _, _, (_, gw, _) = run(h, w, b, mask, y, t, sparse_grad=True)
    # one [d] value row per support entry: O(nnz x d), not [V, d]
    assert gw._values().shape == (mask.nnz, 8)
    touched = set(gw.coalesce()._indices()[0].tolist())
    assert touched == set(mask.token_ids.tolist())


def test_accumulates_in_place_into_an_existing_dense_grad():
    """AccumulateGrad adds a sparse gradient into a dense .grad in place: same storage, the dense
    path's values, and the gradient handed to it is the O(nnz x d) sparse tensor (no second
    dense [V, d] tensor)."""
    h, w, b, mask, y, t = make(10, 300, 16, seed=3, dtype=torch.float32)
    weight = w.clone().requires_grad_(True)
    earlier = torch.randn(300, 16)
    weight.grad = earlier.clone()
    storage = weight.grad.data_ptr()
    seen = []
    weight.register_hook(lambda g: seen.append((g.layout, tuple(g._values().shape) if g.is_sparse else None)))
    mr.replay_logprobs_from_hidden(h, weight, mask, y, t, b, sparse_grad=True).sum().backward()
    assert weight.grad.layout == torch.strided and weight.grad.data_ptr() == storage
    assert seen == [(torch.sparse_coo, (mask.nnz, 16))]
    w_dense = w.clone().requires_grad_(True)
    mr.replay_logprobs_from_hidden(h, w_dense, mask, y, t, b).sum().backward()
    torch.testing.assert_close(weight.grad, earlier + w_dense.grad, rtol=1e-6, atol=1e-6)


def test_backward_allocates_nothing_of_the_weight_s_size():
    """Memory not doubled: with weight.grad already dense, no allocation of the backward comes
    near V x d (the profiler records every CPU allocation); the dense path's does, as a control."""
    from torch.profiler import ProfilerActivity, profile

    v, d = 4000, 64
    h, w, b, mask, y, t = make(8, v, d, seed=7, dtype=torch.float32)
    dense_bytes = v * d * 4

    def largest_allocation(sparse_grad):
        weight = w.clone().requires_grad_(True)
        weight.grad = torch.zeros_like(weight)
        loss = mr.replay_logprobs_from_hidden(h, weight, mask, y, t, sparse_grad=sparse_grad).sum()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss.backward()
        return max((e.cpu_memory_usage for e in prof.events()), default=0)

    assert largest_allocation(sparse_grad=False) >= dense_bytes  # the control sees the dense gradient
    assert largest_allocation(sparse_grad=True) < dense_bytes // 10


def test_fresh_grad_is_sparse_and_sgd_steps_like_dense():
    h, w, b, mask, y, t = make(10, 50, 4, seed=4, dtype=torch.float32)
    ws, wd = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    mr.replay_logprobs_from_hidden(h, ws, mask, y, t, sparse_grad=True).sum().backward()
    mr.replay_logprobs_from_hidden(h, wd, mask, y, t).sum().backward()
    assert ws.grad.is_sparse
    for p in (ws, wd):
        torch.optim.SGD([p], lr=0.1).step()
    torch.testing.assert_close(ws.detach(), wd.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(device, dtype):
    h, w, b, mask, y, t = make(32, 400, 32, seed=5, max_k=20, dtype=dtype, device=device)
    lp_s, _, (gh_s, gw_s, gb_s) = run(h, w, b, mask, y, t, sparse_grad=True)
    truth = hidden_ref(h, w, b, mask.to_dense(400), y, t)
    assert lp_s.dtype == torch.float32
    low = hidden_ref(h, w, b, mask.to_dense(400), y, t, dtype=torch.float32)
    assert (lp_s.double() - truth).abs().max() <= max(4 * (low - truth).abs().max(), 1e-4)
    _, _, (gh_d, gw_d, gb_d) = run(h, w, b, mask, y, t, sparse_grad=False)
    assert gw_s.dtype == dtype and gw_s.is_sparse
    tol = {torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(gw_s.to_dense().float(), gw_d.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(gh_s.float(), gh_d.float(), rtol=tol, atol=tol)
    own = mr.replay_logprobs_from_hidden(h, w, mask, y, t, b, sparse_grad=True, out_dtype=dtype)
    assert own.dtype == dtype
    torch.testing.assert_close(own, lp_s.to(dtype), rtol=0, atol=0)


def test_errors_name_the_row():
    h, w, b, mask, y, t = make(4, 20, 3, seed=6, outside=(2,), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"sampled token \d+ is outside the support of row 2"):
        mr.replay_logprobs_from_hidden(h, w, mask, y, t, sparse_grad=True)
    bad = y.clone()
    bad[1] = 20
    with pytest.raises(ValueError, match=r"sampled token 20 of row 1 is out of range \[0, 20\)"):
        mr.replay_logprobs_from_hidden(h, w, mask, bad, t, sparse_grad=True, fallback=True)
    _, _, _, m_empty, y_e, _ = make(4, 20, 3, seed=6, empty=(3,))
    with pytest.raises(ValueError, match="row 3 has an empty support"):
        mr.replay_logprobs_from_hidden(h, w, m_empty, y_e, t, sparse_grad=True)
    with pytest.raises(ValueError, match="weight is torch.float64 but hidden is torch.float32"):
        mr.replay_logprobs_from_hidden(h, w.double(), mask, y, t, sparse_grad=True, fallback=True)
    with pytest.raises(ValueError, match="the mask has 4 rows but there are 3 rows"):
        mr.replay_logprobs_from_hidden(h[:3], w, mask, y[:3], t[:3], sparse_grad=True)


@given(n=st.integers(0, 7), v=st.integers(2, 25), d=st.integers(1, 6), seed=st.integers(0, 2**16),
       with_fallback=st.booleans())
def test_hypothesis_sparse_equals_dense(n, v, d, seed, with_fallback):
    kw = dict(outside=(0,), empty=(n - 1,)) if with_fallback and n >= 2 else {}
    h, w, b, mask, y, t = make(n, v, d, seed=seed, **kw)
    lp_s, st_s, gs = run(h, w, b, mask, y, t, sparse_grad=True, fallback=True)
    lp_d, st_d, gd = run(h, w, b, mask, y, t, sparse_grad=False, fallback=True)
    torch.testing.assert_close(lp_s, lp_d, rtol=0, atol=1e-12)
    assert st_s.tolist() == st_d.tolist()
    for a, r in zip(gs, gd):
        torch.testing.assert_close(a.to_dense() if a.is_sparse else a, r, rtol=0, atol=1e-12)


def test_gather_path_equals_fused_csr_path(monkeypatch):
    """The CPU runs fp32/fp64 through torch's CSR kernels and everything else (bf16/fp16, CUDA)
    through chunked gathers: both give the same values and gradients (fp64, with fallback rows)."""
    import mask_replay.trainer.sparse_head as sh

    h, w, b, mask, y, t = make(12, 40, 5, seed=8, outside=(4,), empty=(7,))
    fused = run(h, w, b, mask, y, t, sparse_grad=True, fallback=True)
    monkeypatch.setattr(sh, "_fused_csr", lambda _t: False)
    monkeypatch.setattr(sh, "_chunk", lambda device, nnz, d: 3)  # several steps, a ragged last one
    gathered = run(h, w, b, mask, y, t, sparse_grad=True, fallback=True)
    torch.testing.assert_close(fused[0], gathered[0], rtol=0, atol=1e-12)
    for a, r in zip(fused[2], gathered[2]):
        torch.testing.assert_close(a.to_dense() if a.is_sparse else a, r.to_dense() if r.is_sparse else r,
                                   rtol=0, atol=1e-12)
