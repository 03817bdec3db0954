"""Replay ops against the dense reference (tests/helpers.py)."""
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from mask_replay._ops import ops
from mask_replay.trainer.replay import FELL_BACK_EMPTY, FELL_BACK_OUTSIDE, REPLAYED
from tests.helpers import DEVICES, full_ref, grads, hidden_ref, kept_mass_ref, replay_ref

LOW = [torch.float32, torch.bfloat16, torch.float16]


def make_case(n, v, *, seed=0, max_k=6, empty=0.0, device="cpu"):
    """Random supports (some singletons), sampled tokens inside them, logits and a temperature per row."""
    g = torch.Generator().manual_seed(seed)
    rows, sampled = [], []
    for _ in range(n):
        if torch.rand((), generator=g) < empty:
            rows.append([])
            sampled.append(int(torch.randint(v, (), generator=g)))
            continue
        k = int(torch.randint(1, min(max_k, v) + 1, (), generator=g))
        ids = torch.randperm(v, generator=g)[:k].tolist()
        rows.append(ids)
        sampled.append(ids[int(torch.randint(k, (), generator=g))])
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    temp = 0.5 + torch.rand(n, generator=g)
    mask = mr.SamplingMask.from_lists(rows).to(device)
    return logits.to(device), mask, torch.tensor(sampled, dtype=torch.int64, device=device), temp.to(device)


def dense(mask, v):
    return mask.to_dense(v)


def maxabs(t):
    return float(t.abs().max()) if t.numel() else 0.0


def tol_from_reference(truth, ref_low, floor):
    """The kernels must be as close to the fp64 truth as the dense path in the same precision is
    (within a factor), never tighter than floor."""
    return max(4 * maxabs(ref_low - truth), floor)


# ---- forward and gradients against the reference -----------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_replay_matches_reference_fp64(device):
    logits, mask, y, t = make_case(40, 33, seed=1, device=device)
    got = mr.replay_logprobs(logits, mask, y, t)
    want = replay_ref(logits, dense(mask, 33), y, t)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (g,) = grads(lambda z: mr.replay_logprobs(z, mask, y, t), logits)
    (gr,) = grads(lambda z: replay_ref(z, dense(mask, 33), y, t), logits)
    torch.testing.assert_close(g, gr, rtol=0, atol=1e-12)
    assert (g[~dense(mask, 33)] == 0).all()  # zero outside K


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_fp64(device):
    logits, mask, y, t = make_case(7, 12, seed=2, device=device)
    z = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: mr.replay_logprobs(z, mask, y, t), (z,))
    assert torch.autograd.gradcheck(lambda z: mr.full_logprobs(z, y, t), (z,))
    y_out = y.clone()
    y_out[0] = int(torch.nonzero(~dense(mask, 12)[0])[0])  # outside K: falls back
    assert torch.autograd.gradcheck(lambda z: mr.replay_logprobs(z, mask, y_out, t, fallback=True), (z,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gradcheck_hidden_fp64(device, with_bias):
    _, mask, y, t = make_case(6, 15, seed=3, device=device)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    w = torch.randn(15, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    b = torch.randn(15, generator=g, dtype=torch.float64).to(device).requires_grad_(True) if with_bias else None
    args = (h, w) + ((b,) if with_bias else ())
    fn = lambda h, w, b=None: mr.replay_logprobs_from_hidden(h, w, mask, y, t, b)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)
    y_out = y.clone()
    y_out[2] = int(torch.nonzero(~dense(mask, 15)[2])[0])
    fb = lambda h, w, b=None: mr.replay_logprobs_from_hidden(h, w, mask, y_out, t, b, fallback=True)  # noqa: E731
    assert torch.autograd.gradcheck(fb, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_within_reference_error(device, dtype):
    v = 1000
    logits, mask, y, t = make_case(64, v, seed=4, max_k=40, device=device)
    z = logits.to(dtype)  # both paths see the same quantised logits
    dm = dense(mask, v)
    truth = replay_ref(z, dm, y, t)
    ref_low = replay_ref(z, dm, y, t, dtype=torch.float32)  # the dense path as trainers run it
    got = mr.replay_logprobs(z, mask, y, t)
    assert got.dtype == torch.float32
    assert (got.double() - truth).abs().max() <= tol_from_reference(truth, ref_low, 2e-6)
    (g,) = grads(lambda z: mr.replay_logprobs(z, mask, y, t), z)
    (g_truth,) = grads(lambda z: replay_ref(z, dm, y, t), z.double())
    (g_low,) = grads(lambda z: replay_ref(z, dm, y, t, dtype=torch.float32), z.float())
    assert g.dtype == dtype
    g_floor = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert (g.double() - g_truth).abs().max() <= tol_from_reference(g_truth, g_low.to(dtype).double(), g_floor)

    full = mr.full_logprobs(z, y, t)
    f_truth, f_low = full_ref(z, y, t), full_ref(z, y, t, dtype=torch.float32)
    assert (full.double() - f_truth).abs().max() <= tol_from_reference(f_truth, f_low, 2e-6)
    (gf,) = grads(lambda z: mr.full_logprobs(z, y, t), z)
    (gf_truth,) = grads(lambda z: full_ref(z, y, t), z.double())
    (gf_low,) = grads(lambda z: full_ref(z, y, t, dtype=torch.float32), z.float())
    assert (gf.double() - gf_truth).abs().max() <= tol_from_reference(gf_truth, gf_low.to(dtype).double(), g_floor)

    kept = mr.kept_mass(z, mask, t)
    k_truth, k_low = kept_mass_ref(z, dm, t), kept_mass_ref(z, dm, t, dtype=torch.float32)
    assert (kept.double() - k_truth).abs().max() <= tol_from_reference(k_truth, k_low, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
def test_hidden_low_precision(device, dtype):
    v, d = 300, 64
    _, mask, y, t = make_case(32, v, seed=5, max_k=12, device=device)
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(32, d, generator=g) / 4).to(device, dtype)
    w = (torch.randn(v, d, generator=g) / 4).to(device, dtype)
    b = torch.randn(v, generator=g).to(device, dtype)
    dm = dense(mask, v)
    truth = hidden_ref(h, w, b, dm, y, t)
    low = hidden_ref(h, w, b, dm, y, t, dtype=torch.float32)
    got = mr.replay_logprobs_from_hidden(h, w, mask, y, t, b)
    assert (got.double() - truth).abs().max() <= tol_from_reference(truth, low, 1e-5)
    ours = grads(lambda h, w, b: mr.replay_logprobs_from_hidden(h, w, mask, y, t, b), h, w, b)
    exact = grads(lambda h, w, b: hidden_ref(h, w, b, dm, y, t), h.double(), w.double(), b.double())
    lows = grads(lambda h, w, b: hidden_ref(h, w, b, dm, y, t, dtype=torch.float32), h.float(), w.float(), b.float())
    floor = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for o, e, lo in zip(ours, exact, lows):
        assert o.dtype == dtype
        assert (o.double() - e).abs().max() <= tol_from_reference(e, lo.to(dtype).double(), floor)
    # the weight gradient touches only rows that appear in some support
    used = dm.any(0)
    assert (ours[1][~used] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_hidden_matches_dense_fp32_to_1e5(device):
    v, d = 2000, 256
    _, mask, y, t = make_case(64, v, seed=6, max_k=30, device=device)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(64, d, generator=g).to(device)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(device)
    got = mr.replay_logprobs_from_hidden(h, w, mask, y, t)
    dense_path = mr.replay_logprobs(h @ w.T, mask, y, t)
    torch.testing.assert_close(got, dense_path, rtol=0, atol=1e-5)


# ---- semantics of special rows --------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_singleton_rows_give_zero_and_zero_grad(device):
    z = torch.randn(3, 10, dtype=torch.float32, device=device, requires_grad=True)
    mask = mr.SamplingMask.from_lists([[4], [0], [9]]).to(device)
    y = torch.tensor([4, 0, 9], device=device)
    lp = mr.replay_logprobs(z, mask, y, torch.tensor([0.3, 1.0, 7.0]))
    assert torch.equal(lp, torch.zeros(3, device=device))
    lp.sum().backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_temperature(device):
    logits, mask, y, _ = make_case(20, 25, seed=7, device=device)
    t = torch.linspace(0.1, 5.0, 20, device=device)
    got = mr.replay_logprobs(logits, mask, y, t)
    torch.testing.assert_close(got, replay_ref(logits, dense(mask, 25), y, t), rtol=0, atol=1e-12)
    # a row's result depends on its own temperature only
    one = mr.replay_logprobs(logits[3:4], mask.select_rows(3, 4), y[3:4], float(t[3]))
    torch.testing.assert_close(one, got[3:4], rtol=0, atol=0)
    scalar = mr.replay_logprobs(logits, mask, y, 0.7)
    torch.testing.assert_close(scalar, replay_ref(logits, dense(mask, 25), y, 0.7), rtol=0, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_outside_support_errors_then_falls_back(device):
    z = torch.randn(3, 8, dtype=torch.float64, device=device)
    mask = mr.SamplingMask.from_lists([[1, 2], [3, 4], [5]]).to(device)
    y = torch.tensor([1, 6, 5], device=device)
    with pytest.raises(RuntimeError, match=re.escape("replay: sampled token 6 is outside the support of row 1")):
        mr.replay_logprobs(z, mask, y)
    lp, status = mr.replay_logprobs(z, mask, y, fallback=True, return_status=True)
    assert status.tolist() == [REPLAYED, FELL_BACK_OUTSIDE, REPLAYED]
    torch.testing.assert_close(lp[1], torch.log_softmax(z[1], 0)[6])
    torch.testing.assert_close(lp, replay_ref(z, dense(mask, 8), y, fallback=True))
    zz = z.clone().requires_grad_(True)
    mr.replay_logprobs(zz, mask, y, fallback=True).sum().backward()
    torch.testing.assert_close(zz.grad[1], torch.eye(8, dtype=z.dtype, device=device)[6] - torch.softmax(z[1], 0))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_row_errors_then_falls_back(device):
    z = torch.randn(3, 8, dtype=torch.float64, device=device)
    mask = mr.SamplingMask.from_lists([[1, 2], [], [5]]).to(device)
    y = torch.tensor([2, 3, 5], device=device)
    with pytest.raises(RuntimeError, match="replay: row 1 has an empty support"):
        mr.replay_logprobs(z, mask, y)
    lp, status = mr.replay_logprobs(z, mask, y, fallback=True, return_status=True)
    assert status.tolist() == [0, FELL_BACK_EMPTY, 0]
    torch.testing.assert_close(lp[1], torch.log_softmax(z[1], 0)[3])
    assert float(mr.kept_mass(z, mask)[1]) == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_hidden_fallback_status(device):
    _, mask, y, t = make_case(5, 20, seed=8, empty=0.4, device=device)
    h = torch.randn(5, 6, dtype=torch.float64, device=device)
    w = torch.randn(20, 6, dtype=torch.float64, device=device)
    lp, status = mr.replay_logprobs_from_hidden(h, w, mask, y, t, fallback=True, return_status=True)
    empty = (mask.lengths() == 0).to(device)
    assert empty.any() and torch.equal(status == FELL_BACK_EMPTY, empty)
    torch.testing.assert_close(lp, hidden_ref(h, w, None, dense(mask, 20), y, t, fallback=True))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows(device):
    z = torch.zeros(0, 11, device=device, requires_grad=True)
    mask = mr.SamplingMask.from_lists([]).to(device)
    y = torch.zeros(0, dtype=torch.int64, device=device)
    lp = mr.replay_logprobs(z, mask, y)
    assert lp.shape == (0,)
    lp.sum().backward()
    assert z.grad.shape == (0, 11)
    assert mr.full_logprobs(z, y).shape == (0,)
    assert mr.kept_mass(z, mask).shape == (0,)
    h = torch.zeros(0, 4, device=device, requires_grad=True)
    w = torch.randn(11, 4, device=device, requires_grad=True)
    out = mr.replay_logprobs_from_hidden(h, w, mask, y)
    out.sum().backward()
    assert out.shape == (0,) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    logits, mask, y, t = make_case(12, 30, seed=9, device=device)
    wide = torch.randn(12, 64, dtype=torch.float64, device=device)
    wide[:, :30] = logits
    sliced = wide[:, :30]  # padded vocabulary: row stride 64
    transposed = logits.T.contiguous().T  # column-major
    y_strided = torch.stack([y, y], 1)[:, 0]
    t_strided = torch.stack([t, t], 1)[:, 1]
    want = replay_ref(logits, dense(mask, 30), y, t)
    for z in (sliced, transposed):
        assert not z.is_contiguous()
        torch.testing.assert_close(mr.replay_logprobs(z, mask, y_strided, t_strided), want, rtol=0, atol=1e-12)
        (g,) = grads(lambda q: mr.replay_logprobs(q, mask, y, t), z)
        (gr,) = grads(lambda q: replay_ref(q, dense(mask, 30), y, t), logits)
        torch.testing.assert_close(g, gr, rtol=0, atol=1e-12)
        torch.testing.assert_close(mr.full_logprobs(z, y_strided, t_strided), full_ref(logits, y, t))
        torch.testing.assert_close(mr.kept_mass(z, mask, t_strided), kept_mass_ref(logits, dense(mask, 30), t))
    h = torch.randn(8, 12, dtype=torch.float64, device=device)[:, ::2]  # [12, 6], column stride 2
    w_full = torch.randn(30, 10, dtype=torch.float64, device=device)
    w = w_full[:, :6]  # row stride 10
    h12 = torch.randn(12, 12, dtype=torch.float64, device=device)[:, ::2]
    got = mr.replay_logprobs_from_hidden(h12, w, mask, y, t)
    torch.testing.assert_close(got, hidden_ref(h12, w, None, dense(mask, 30), y, t))
    assert h.shape == (8, 6)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_gradient_is_deterministic(device):
    _, mask, y, t = make_case(200, 50, seed=10, max_k=20, device=device)
    h = torch.randn(200, 32, device=device)
    w = torch.randn(50, 32, device=device)
    runs = [grads(lambda h, w: mr.replay_logprobs_from_hidden(h, w, mask, y, t), h, w) for _ in range(3)]
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], r))


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_bad_temperature_names_the_row(device):
    z = torch.randn(3, 5, device=device)
    mask = mr.SamplingMask.from_lists([[0], [1], [2]]).to(device)
    y = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(RuntimeError, match="temperature must be finite and > 0, row 2 has -1"):
        mr.replay_logprobs(z, mask, y, torch.tensor([1.0, 2.0, -1.0], device=device))
    with pytest.raises(RuntimeError, match="row 0 has nan"):
        mr.replay_logprobs(z, mask, y, torch.tensor([float("nan"), 1.0, 1.0], device=device))
    with pytest.raises(RuntimeError, match="row 1 has inf"):
        mr.full_logprobs(z, y, torch.tensor([1.0, float("inf"), 1.0], device=device))
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        mr.replay_logprobs(z, mask, y, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device):
    def dev(*args, **kwargs):
        return torch.tensor(*args, **kwargs, device=device)

    z = torch.randn(3, 5, device=device)
    mask = mr.SamplingMask.from_lists([[0], [1], [2]]).to(device)
    y = dev([0, 1, 2])
    t = torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match="the mask has 2 rows"):
        mr.replay_logprobs(z, mask.select_rows(0, 2), y)
    with pytest.raises(RuntimeError, match="token_ids must be a 1-D int32"):
        ops.replay_fwd(z, mask.token_ids.long(), mask.offsets, y, t, False)
    with pytest.raises(RuntimeError, match="temperature must be Float"):
        ops.replay_fwd(z, mask.token_ids, mask.offsets, y, t.double(), False)
    with pytest.raises(RuntimeError, match="logits must be 2-D"):
        ops.replay_fwd(z[0], mask.token_ids, mask.offsets, y, t, False)
    with pytest.raises(RuntimeError, match="logits must be float32, bfloat16, float16 or float64"):
        ops.replay_fwd(z.int(), mask.token_ids, mask.offsets, y, t, False)
    with pytest.raises(RuntimeError, match="sampled token 5 of row 1 is out of range"):
        mr.replay_logprobs(z, mask, dev([0, 5, 2]), fallback=True)
    bad_ids = mr.SamplingMask(dev([0, 7, 2], dtype=torch.int32), mask.offsets)
    with pytest.raises(RuntimeError, match="token_ids of row 1 hold an id outside"):
        mr.replay_logprobs(z, bad_ids, y)
    unsorted = mr.SamplingMask(dev([0, 3, 1, 2], dtype=torch.int32), dev([0, 1, 3, 4]))
    with pytest.raises(RuntimeError, match="token_ids of row 1 are not strictly ascending"):
        mr.replay_logprobs(z, unsorted, dev([0, 1, 2]))
    bad_off = mr.SamplingMask(mask.token_ids, dev([0, 2, 1, 3]))
    with pytest.raises(RuntimeError, match="offsets are invalid at row 1"):
        mr.kept_mass(z, bad_off)
    with pytest.raises(RuntimeError, match="weight has d = 4 but hidden has d = 3"):
        mr.replay_logprobs_from_hidden(torch.randn(3, 3, device=device), torch.randn(5, 4, device=device), mask, y)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        mr.replay_logprobs_from_hidden(torch.randn(3, 4, device=device), torch.randn(5, 4, device=device), mask, y,
                                       bias=torch.randn(4, device=device))
    with pytest.raises(ValueError, match="sampled must be a tensor of shape"):
        mr.replay_logprobs(z, mask, dev([0, 1]))


def test_capture_call_signature():
    """capture.py calls the raw ops this way; lse is over the support for replayed rows and over the
    whole row for fallback rows."""
    z = torch.randn(2, 6)
    mask = mr.SamplingMask.from_lists([[0, 1], [2]])
    t = torch.ones(2)
    logp, lse, status = ops.replay_fwd(z, mask.token_ids, mask.offsets, torch.tensor([1, 4]), t, True)
    assert status.dtype == torch.int8 and status.tolist() == [0, 1]
    torch.testing.assert_close(lse, torch.stack([torch.logsumexp(z[0, :2], 0), torch.logsumexp(z[1], 0)]))
    assert ops.kept_mass(z, mask.token_ids, mask.offsets, t).dtype == torch.float32


# ---- torch.library / torch.compile ---------------------------------------------------------------
def _op_samples(device):
    logits, mask, y, t = make_case(6, 10, seed=11, device=device)
    y_fb = y.clone()
    y_fb[1] = int(torch.nonzero(~dense(mask, 10)[1])[0])
    z = logits.float().requires_grad_(True)
    ids, off = mask.token_ids, mask.offsets
    h = torch.randn(6, 4, device=device, requires_grad=True)
    w = torch.randn(10, 4, device=device, requires_grad=True)
    b = torch.randn(10, device=device, requires_grad=True)
    tf = t.float()
    logp, lse, status = ops.replay_fwd(z, ids, off, y_fb, tf, True)
    flp, flse = ops.full_fwd(z, y, tf)
    hlp, hlse, hst = ops.hidden_fwd(h, w, b, ids, off, y_fb, tf, True)
    g = torch.randn(6, device=device)
    return [
        (ops.replay_fwd.default, (z, ids, off, y, tf, False)),
        (ops.replay_fwd.default, (z, ids, off, y_fb, tf, True)),
        (ops.replay_bwd.default, (g, z.detach(), ids, off, y_fb, tf, lse.detach(), status)),
        (ops.full_fwd.default, (z, y, tf)),
        (ops.full_bwd.default, (g, z.detach(), y, tf, flse.detach())),
        (ops.kept_mass.default, (z.detach(), ids, off, tf)),
        (ops.hidden_fwd.default, (h, w, b, ids, off, y_fb, tf, True)),
        (ops.hidden_fwd.default, (h, w, h.new_empty(0), ids, off, y, tf, False)),
        (ops.hidden_bwd.default, (g, h.detach(), w.detach(), b.detach(), ids, off, y_fb, tf, hlse.detach(), hst)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _op_samples(device):
        torch.library.opcheck(op, args)


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward(device, backend):
    torch._dynamo.reset()
    logits, mask, y, t = make_case(16, 40, seed=12, device=device)
    z = logits.float()
    h = torch.randn(16, 8, device=device)
    w = torch.randn(40, 8, device=device)

    def loss(z, h, w):
        a = mr.replay_logprobs(z, mask, y, t)
        b = mr.replay_logprobs_from_hidden(h, w, mask, y, t)
        c = mr.full_logprobs(z, y, 0.8)
        return (a * 1.5 + b - c).sum()

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    eager = grads(loss, z, h, w)
    got = grads(compiled, z, h, w)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


# ---- properties ----------------------------------------------------------------------------------
@given(
    n=st.integers(0, 7),
    v=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    scalar_t=st.one_of(st.none(), st.floats(0.05, 20.0)),
    empty=st.sampled_from([0.0, 0.3]),
    outside=st.booleans(),
)
def test_property_replay_matches_reference(n, v, seed, dtype, scalar_t, empty, outside):
    logits, mask, y, t = make_case(n, v, seed=seed, max_k=v, empty=empty)
    if outside and n:
        y = torch.randint(v, (n,), generator=torch.Generator().manual_seed(seed))
    temp = t if scalar_t is None else scalar_t
    z = logits.to(dtype)
    dm = dense(mask, v)
    lp, status = mr.replay_logprobs(z, mask, y, temp, fallback=True, return_status=True)
    inside = dm.gather(1, y[:, None])[:, 0] if n else torch.zeros(0, dtype=torch.bool)
    want_status = torch.where(mask.lengths() == 0, 2, torch.where(inside, 0, 1)).to(torch.int8)
    assert torch.equal(status, want_status)
    truth = replay_ref(z, dm, y, temp, fallback=True)
    low = replay_ref(z, dm, y, temp, fallback=True, dtype=torch.float32)
    floor = 1e-12 if dtype == torch.float64 else 2e-6
    assert maxabs(lp.double() - truth) <= tol_from_reference(truth, low, floor)
    assert (lp <= 1e-6).all()  # a log-probability
    singleton_inside = (mask.lengths() == 1) & (status == 0)
    assert (lp[singleton_inside] == 0).all()
    (g,) = grads(lambda q: mr.replay_logprobs(q, mask, y, temp, fallback=True), z)
    (g_truth,) = grads(lambda q: replay_ref(q, dm, y, temp, fallback=True), z.double())
    rows_replayed = status == 0
    assert (g[rows_replayed][~dm[rows_replayed]] == 0).all()  # zero outside K
    (g_low,) = grads(lambda q: replay_ref(q, dm, y, temp, fallback=True, dtype=torch.float32), z.float())
    g_floor = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert maxabs(g.double() - g_truth) <= tol_from_reference(g_truth, g_low.to(dtype).double(), g_floor)
    kept = mr.kept_mass(z, mask, temp)
    assert ((kept >= 0) & (kept <= 1 + 1e-6)).all()


@given(
    n=st.integers(0, 6),
    v=st.integers(1, 30),
    d=st.integers(1, 19),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    outside=st.booleans(),
)
def test_property_hidden_matches_reference(n, v, d, seed, dtype, with_bias, outside):
    _, mask, y, t = make_case(n, v, seed=seed, max_k=v, empty=0.2)
    if outside and n:
        y = torch.randint(v, (n,), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = torch.randn(v, d, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if with_bias else None
    dm = dense(mask, v)
    lp, status = mr.replay_logprobs_from_hidden(h, w, mask, y, t, b, fallback=True, return_status=True)
    truth = hidden_ref(h, w, b, dm, y, t, fallback=True)
    low = hidden_ref(h, w, b, dm, y, t, fallback=True, dtype=torch.float32)
    floor = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    assert maxabs(lp.double() - truth) <= tol_from_reference(truth, low, floor)
    args = (h, w) + ((b,) if with_bias else ())
    ours = grads(lambda *a: mr.replay_logprobs_from_hidden(a[0], a[1], mask, y, t, a[2] if with_bias else None,
                                                           fallback=True), *args)
    exact = grads(lambda *a: hidden_ref(a[0], a[1], a[2] if with_bias else None, dm, y, t, fallback=True),
                  *[a.double() for a in args])
    for o, e in zip(ours, exact):
        assert o.dtype == dtype
        scale = 1.0 + float(e.abs().max()) if e.numel() else 1.0
        assert maxabs(o.double() - e) <= floor * scale * (4 if dtype == torch.bfloat16 else 1)
    used = dm.any(0) if n else torch.zeros(v, dtype=torch.bool)
    fell_back = (status != 0).any()
    if not fell_back:  # only rows of some support get a weight gradient
        assert (ours[1][~used] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_logits_poison_exactly_the_rows_that_read_them(dtype):
    # NaN inside a row's support poisons replay; anywhere in the row poisons the full-vocabulary
    # ops (they read the whole row); other rows are untouched.
    x = torch.randn(3, 10)
    x[1, 2] = float("nan")  # inside row 1's support
    x[2, 7] = float("nan")  # outside row 2's support
    x = x.to(dtype)
    m = mr.SamplingMask.from_lists([[0, 1], [2, 3], [4, 5]])
    s = torch.tensor([0, 3, 4])
    rep = mr.replay_logprobs(x, m, s)
    assert torch.isnan(rep).tolist() == [False, True, False]
    assert torch.isnan(mr.full_logprobs(x, s)).tolist() == [False, True, True]
    assert torch.isnan(mr.kept_mass(x, m)).tolist() == [False, True, True]
