"""replay_support_logprobs in every layout, from hidden states and vocab-parallel, against a dense
float64 reference (mask.to_dense + masked log_softmax, gathered at the mask's entries)."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mask_replay as mr
from mask_replay import SamplingMask
from mask_replay.trainer.support_logprobs import replay_support_logprobs_from_hidden, support_logprobs_padded
from tests.helpers import DEVICES, grads, torchrun

INF = float("inf")
WORKER = os.path.join(os.path.dirname(__file__), "support_logprobs_worker.py")


def entries_ref(logits, mask, temperature=1.0):
    """The dense reference: log_softmax over the support of every row (float64), read at each entry."""
    t = torch.as_tensor(temperature, dtype=torch.float64, device=logits.device).reshape(-1, 1)
    x = (logits.double() / t).masked_fill(~mask.to_dense(logits.shape[-1]).to(logits.device), -INF)
    logq = torch.log_softmax(x, dim=1)
    return logq[mask.row_ids().to(logits.device), mask.token_ids.long().to(logits.device)]


def random_mask(n, v, seed, max_k=6, empty=0.0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = 0 if float(torch.rand(1, generator=g)) < empty else int(torch.randint(1, max_k + 1, (1,), generator=g))
        rows.append(torch.randperm(v, generator=g)[:k].tolist())
    return SamplingMask.from_lists(rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_values_and_gradients_match_dense_reference(device, dtype):
    n, v = 12, 50
    mask = random_mask(n, v, seed=1, empty=0.2)
    logits = (torch.randn(n, v, generator=torch.Generator().manual_seed(2)) * 3).to(dtype).to(device)
    temp = torch.rand(n, generator=torch.Generator().manual_seed(3)) + 0.4
    got = mr.replay_support_logprobs(logits, mask, temperature=temp.to(device))
    want = entries_ref(logits, mask, temp.to(device))
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (mask.nnz,)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got.double(), want, atol=tol, rtol=0)
    (g,) = grads(lambda z: mr.replay_support_logprobs(z, mask, temperature=temp.to(device)), logits)
    (gr,) = grads(lambda z: entries_ref(z, mask, temp.to(device)), logits.double())
    gtol = 1e-10 if dtype == torch.float64 else 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(g.double(), gr, atol=gtol, rtol=gtol)
    # zero outside the support
    assert not bool(g[~mask.to_dense(v).to(device)].any())


@pytest.mark.slow
def test_gradcheck_float64():
    mask = SamplingMask.from_lists([[0, 3, 4], [1], [2, 5], [], [0, 1, 2, 3, 4, 5]])
    z = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.7], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: mr.replay_support_logprobs(x, mask, temperature=t), (z,))
    assert torch.autograd.gradgradcheck(lambda x: mr.replay_support_logprobs(x, mask, temperature=t), (z,))


def test_edge_rows_singleton_neg_inf_and_empty():
    z = torch.tensor([[1.0, 2.0, 3.0], [0.5, -INF, 1.0], [-INF, -INF, 0.0], [5.0, 1.0, 1.0]], requires_grad=True)
    mask = SamplingMask.from_lists([[1], [0, 1, 2], [0, 1], []])
    out = mr.replay_support_logprobs(z, mask)
    assert out[0].item() == 0.0  # |S| = 1
    assert out[2].item() == -INF  # the -inf entry has probability 0
    assert torch.isclose(torch.logsumexp(out[1:4], 0), torch.tensor(0.0), atol=1e-6)
    assert out[4].item() == -INF and out[5].item() == -INF  # a row with nothing finite
    out.masked_fill(torch.isinf(out), 0).sum().backward()
    assert torch.isfinite(z.grad).all()
    assert not bool(z.grad[0].any())  # a singleton row has no gradient
    assert not bool(z.grad[2].any()) and not bool(z.grad[3].any())


def test_nan_logit_gives_nan_in_its_row_only():
    z = torch.tensor([[float("nan"), 1.0], [1.0, 2.0]])
    out = mr.replay_support_logprobs(z, SamplingMask.from_lists([[0, 1], [0, 1]]))
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2:]).all()


def test_matches_capture_entry_logprobs_on_the_same_logits():
    z = torch.randn(16, 100, generator=torch.Generator().manual_seed(5)) * 4
    mask = mr.capture(z, temperature=0.8, top_p=0.9, sampled=z.argmax(1), entry_logprobs=True)
    got = mr.replay_support_logprobs(z, mask, temperature=0.8)
    assert torch.allclose(got, mask.entry_logprobs, atol=1e-6, rtol=0)


# ---- trainer layouts ----------------------------------------------------------------------------------
def _batch(seed=0, b=3, t=7, v=30):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :2] = -100
    labels[2, 5:] = -100
    labels[1, 3] = -100
    kept = (labels != -100).reshape(-1)
    rows = [sorted(set(torch.randint(0, v, (4,), generator=g).tolist()) | {int(y)})
            for y in labels.reshape(-1)[kept]]
    return labels, SamplingMask.from_lists(rows), torch.randn(b, t + 1, v, generator=g) * 2


def test_btv_with_labels_and_strided_view():
    labels, mask, full = _batch()
    logits = full[:, :-1]  # a strided view, as trainers shift their logits
    got = mr.replay_support_logprobs(logits, mask, labels, temperature=0.9)
    flat = logits.reshape(-1, logits.shape[-1])[(labels != -100).reshape(-1)]
    assert torch.allclose(got.double(), entries_ref(flat, mask, 0.9), atol=1e-6)
    (g,) = grads(lambda z: mr.replay_support_logprobs(z[:, :-1], mask, labels, temperature=0.9), full)
    (gr,) = grads(lambda z: entries_ref(z[:, :-1].reshape(-1, z.shape[-1])[(labels != -100).reshape(-1)], mask, 0.9),
                  full.double())
    assert torch.allclose(g.double(), gr, atol=1e-5)
    assert not bool(g[:, -1].any())  # the position no label points at
    # per-sequence temperature [B]
    temp = torch.tensor([0.5, 1.0, 1.5])
    got = mr.replay_support_logprobs(logits, mask, labels, temperature=temp)
    per_row = temp[:, None].expand(labels.shape).reshape(-1)[(labels != -100).reshape(-1)]
    assert torch.allclose(got.double(), entries_ref(flat, mask, per_row), atol=1e-6)


def test_packed_with_cu_seqlens_and_loss_mask():
    labels, mask, full = _batch(seed=3)
    packed = full[:, :-1].reshape(-1, full.shape[-1])
    lab = labels.reshape(-1)
    cu = torch.tensor([0, 7, 14, 21])
    temp = torch.tensor([0.6, 1.0, 1.3])
    got = mr.replay_support_logprobs(packed, mask, lab, temperature=temp, cu_seqlens=cu)
    per_row = torch.repeat_interleave(temp, torch.tensor([7, 7, 7]))[lab != -100]
    assert torch.allclose(got.double(), entries_ref(packed[lab != -100], mask, per_row), atol=1e-6)
    via_loss_mask = mr.replay_support_logprobs(full[:, :-1], mask, loss_mask=(labels != -100).int())
    assert torch.allclose(via_loss_mask, mr.replay_support_logprobs(full[:, :-1], mask, labels))


def test_layout_errors_name_the_problem():
    labels, mask, full = _batch()
    with pytest.raises(ValueError, match="the mask has .* rows but the batch has"):
        mr.replay_support_logprobs(full[:, :-1], mask.select_rows(0, 3), labels)
    with pytest.raises(ValueError, match="need labels"):
        mr.replay_support_logprobs(full, mask)
    with pytest.raises(ValueError, match="labels must have shape"):
        mr.replay_support_logprobs(full[:, :-1], mask, labels[:, :3])
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        mr.replay_support_logprobs(full[:, :-1], mask, labels, temperature=torch.tensor([1.0, 0.0, 1.0]))
    bad = SamplingMask(torch.tensor([0, 99], dtype=torch.int32), torch.tensor([0, 2]))
    with pytest.raises(mr.MaskFormatError, match="row 0"):
        mr.replay_support_logprobs(torch.zeros(1, 30), bad)


def test_padded_view():
    labels, mask, full = _batch()
    logits = full[:, :-1]
    values = mr.replay_support_logprobs(logits, mask, labels)
    padded = support_logprobs_padded(values, mask, labels)
    ids, counts, _ = SamplingMask(mask.token_ids, mask.offsets, entry_logprobs=values.detach()).to_padded()
    assert padded.shape == labels.shape + (ids.shape[1],)
    kept = padded.reshape(-1, ids.shape[1])[(labels != -100).reshape(-1)]
    slots = torch.arange(ids.shape[1])[None, :] < counts[:, None].long()
    assert torch.equal(kept[slots], values)
    assert bool((kept[~slots] == -INF).all()) and bool((padded[labels == -100] == -INF).all())
    zero = support_logprobs_padded(values, mask, labels, fill=0.0)
    assert bool((zero[labels == -100] == 0).all())
    flat = support_logprobs_padded(values, mask)
    assert flat.shape == (mask.num_rows, ids.shape[1]) and torch.equal(flat[slots], values)
    with pytest.raises(ValueError, match="width must be"):
        support_logprobs_padded(values, mask, width=1)


# ---- from hidden states -------------------------------------------------------------------------------
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_from_hidden_matches_logits_path(sparse_grad):
    g = torch.Generator().manual_seed(7)
    n, v, d = 10, 40, 8
    hidden, weight, bias = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g), torch.randn(v, generator=g)
    mask = random_mask(n, v, seed=8)
    temp = 0.8
    got = replay_support_logprobs_from_hidden(hidden, weight, mask, temperature=temp, bias=bias,
                                              sparse_grad=sparse_grad)
    want = entries_ref(hidden.double() @ weight.double().T + bias.double(), mask, temp)
    assert torch.allclose(got.double(), want, atol=1e-5)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    replay_support_logprobs_from_hidden(h, w, mask, temperature=temp, bias=b, sparse_grad=sparse_grad).sum().backward()
    hr, wr, br = (t.double().clone().requires_grad_() for t in (hidden, weight, bias))
    entries_ref(hr @ wr.T + br, mask, temp).sum().backward()
    assert w.grad.is_sparse == sparse_grad
    assert torch.allclose(h.grad.double(), hr.grad, atol=1e-5)
    assert torch.allclose(w.grad.to_dense().double(), wr.grad, atol=1e-5)
    assert torch.allclose(b.grad.double(), br.grad, atol=1e-5)


# ---- random shapes --------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 8), v=st.integers(1, 20), seed=st.integers(0, 10_000), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_random_shapes_match_reference(n, v, seed, scale):
    mask = random_mask(n, v, seed, max_k=v, empty=0.2)
    z = torch.randn(n, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    got = mr.replay_support_logprobs(z, mask, temperature=0.7)
    assert torch.allclose(got, entries_ref(z, mask, 0.7), atol=1e-12)


# ---- torch.compile --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiles_fullgraph():
    z = torch.randn(6, 20, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mask = random_mask(6, 20, seed=2)

    def f(logits):
        return mr.replay_support_logprobs(logits, mask, temperature=0.9)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(z)
    assert torch.allclose(out, f(z), atol=1e-6)
    (gc,) = torch.autograd.grad(out.sum(), z)
    (ge,) = torch.autograd.grad(f(z).sum(), z)
    assert torch.allclose(gc, ge, atol=1e-6)


# ---- vocab-parallel -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_vocab_parallel_matches_single_process():
    proc = torchrun(2, WORKER, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        assert f"rank {rank}: support log-probs ok" in proc.stdout, proc.stdout[-3000:]


def _head_case(seed=3, n=5, v=17, d=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g), torch.randn(v, d, generator=g), torch.randn(v, generator=g),
            random_mask(n, v, seed=seed, empty=0.2))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_from_hidden_traces_fullgraph_and_matches_eager(backend):
    """Issue 30: the eager mask check (a device read-back) stopped the trace on a data-dependent guard."""
    hidden, weight, bias, mask = _head_case()
    t = torch.linspace(0.6, 1.4, hidden.shape[0])

    def f(h, w, b):
        return mr.replay_support_logprobs_from_hidden(h, w, mask, temperature=t, bias=b)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(hidden, weight, bias), f(hidden, weight, bias))
    for got, want in zip(grads(compiled, hidden, weight, bias), grads(f, hidden, weight, bias)):
        torch.testing.assert_close(got, want)


def test_from_hidden_under_compile_refuses_sparse_grad_by_name():
    hidden, weight, _, mask = _head_case()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, w: mr.replay_support_logprobs_from_hidden(h, w, mask, sparse_grad=True),
                             fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="sparse_grad=True .* is not supported under torch.compile"):
        compiled(hidden, weight)
