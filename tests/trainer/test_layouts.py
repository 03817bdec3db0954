"""replay_logprobs over trainer layouts ([B, T, V] with ignored positions, packed with cu_seqlens)
and SamplingMask.align, against the dense reference applied to the kept positions."""
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from mask_replay.trainer.layouts import IGNORED, _rows_of
from mask_replay.trainer.replay import FELL_BACK_OUTSIDE
from tests.helpers import DEVICES, replay_ref


def make_batch(b, t, v, *, seed=0, ignore=0.3, max_k=4, device="cpu"):
    """Labels [B, T] with ignored positions (-100), one support per kept position holding its label."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < ignore] = -100
    rows = []
    for y in labels[labels != -100].tolist():
        k = int(torch.randint(1, min(max_k, v) + 1, (), generator=g))
        rows.append(sorted({y, *torch.randperm(v, generator=g)[: k - 1].tolist()}))
    return labels.to(device), mr.SamplingMask.from_lists(rows).to(device)


def reference(logits, mask, labels, temperature=1.0, keep=None):
    """Dense reference: kept positions gathered row-major, masked log_softmax, scattered back."""
    keep = labels != -100 if keep is None else keep
    v = logits.shape[-1]
    t = torch.as_tensor(temperature, dtype=torch.float64)
    t_kept = t.expand(labels.shape)[keep] if t.dim() else t
    lp = replay_ref(logits[keep], mask.to_dense(v), labels[keep], t_kept)
    out = torch.zeros(labels.shape, dtype=lp.dtype, device=lp.device)
    out[keep] = lp
    return out


def layouts(b, t, v, g):
    """The same [B, T, V] values in the layouts trainers hand over."""
    base = torch.randn(b, t + 1, v, generator=g, dtype=torch.float64) * 3
    return {
        "contiguous": base[:, :-1].contiguous(),
        "shifted": base[:, :-1],                                  # logits[:, :-1] of the forward
        "response": base[:, 1:],                                  # logits[:, -R:] style slice
        "time_major": base[:, :-1].transpose(0, 1).contiguous().transpose(0, 1),  # a [T, B, V] buffer
        "vocab_strided": torch.randn(b, t, 2 * v, generator=g, dtype=torch.float64)[..., ::2],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["contiguous", "shifted", "response", "time_major", "vocab_strided"])
def test_layouts_match_reference_and_gradients(device, name):
    b, t, v = 3, 6, 13
    labels, mask = make_batch(b, t, v, seed=1, device=device)
    logits = layouts(b, t, v, torch.Generator().manual_seed(2))[name].to(device)
    temp = 0.7
    got = mr.replay_logprobs(logits, mask, labels, temp)
    want = reference(logits, mask, labels, temp)
    assert got.shape == (b, t)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got[labels == -100] == 0).all()

    z = logits.detach().clone().requires_grad_(True)
    w = torch.linspace(0.5, 1.5, b * t, dtype=torch.float64, device=device).reshape(b, t)
    (g,) = torch.autograd.grad((mr.replay_logprobs(z, mask, labels, temp) * w).sum(), z)
    z2 = logits.detach().clone().requires_grad_(True)
    (g2,) = torch.autograd.grad((reference(z2, mask, labels, temp) * w).sum(), z2)
    torch.testing.assert_close(g, g2, rtol=0, atol=1e-12)
    assert (g[labels == -100] == 0).all()  # no gradient at ignored positions


@pytest.mark.parametrize("name", ["contiguous", "shifted", "response", "time_major", "vocab_strided"])
def test_layouts_never_copy_the_logits(name):
    """The replay op reads the logits' own memory: the rows view shares their storage."""
    logits = layouts(2, 5, 7, torch.Generator().manual_seed(0))[name]
    rows_map = _rows_of(logits)
    assert rows_map.kind in ("view", "strided")
    rows = rows_map.view(logits)
    assert rows.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    # and every position's row is the position's own logits
    pos = rows_map.positions(logits.shape[:-1], "cpu")
    torch.testing.assert_close(rows[pos], logits.reshape(-1, 7), rtol=0, atol=0)


def test_exotic_layout_is_copied_and_still_right():
    """Overlapping rows (no strided view can address them) take the documented copy."""
    b, t, v = 2, 4, 6
    storage = torch.randn(40, dtype=torch.float64)
    logits = storage.as_strided((b, t, v), (5, 3, 1))  # rows overlap: no 2-D view of positions
    assert _rows_of(logits).kind == "copy"
    labels, mask = make_batch(b, t, v, seed=3)
    z = logits.detach().clone().requires_grad_(True)
    torch.testing.assert_close(mr.replay_logprobs(logits, mask, labels), reference(logits, mask, labels),
                               rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: mr.replay_logprobs(z, mask, labels), (z,))


def test_gradcheck_shifted_fp64():
    labels, mask = make_batch(2, 4, 9, seed=4, ignore=0.4)
    full = torch.randn(2, 5, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: mr.replay_logprobs(f[:, :-1], mask, labels, 0.8), (full,))


def test_loss_mask_and_ignore_index():
    b, t, v = 2, 5, 10
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    labels = torch.randint(v, (b, t), generator=g)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]])
    labels[1, 4] = 7
    labels[0, 3] = -100  # ignored by its label even though loss_mask is 1 there
    keep = (loss_mask != 0) & (labels != -100)
    mask = mr.SamplingMask.from_lists([[y, (y + 2) % v] for y in labels[keep].tolist()])
    got = mr.replay_logprobs(logits, mask, labels, loss_mask=loss_mask)
    torch.testing.assert_close(got, reference(logits, mask, labels, keep=keep), rtol=0, atol=1e-12)
    # a custom ignore index
    lab2 = labels.masked_fill(~keep, -1)
    got2 = mr.replay_logprobs(logits, mask, lab2, ignore_index=-1)
    torch.testing.assert_close(got2, got, rtol=0, atol=0)


def test_loss_mask_without_labels_uses_mask_sampled():
    b, t, v = 2, 3, 8
    logits = torch.randn(b, t, v, dtype=torch.float64)
    loss_mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    ys = [1, 4, 6, 2]
    mask = mr.SamplingMask.from_lists([[y, 0] if y else [1, 3] for y in ys], sampled=torch.tensor(ys))
    labels = torch.full((b, t), -100)
    labels[loss_mask] = torch.tensor(ys)
    got = mr.replay_logprobs(logits, mask, None, loss_mask=loss_mask)
    torch.testing.assert_close(got, reference(logits, mask, labels), rtol=0, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_with_cu_seqlens_and_per_sequence_temperature(device):
    v = 11
    cu = torch.tensor([0, 4, 4, 9, 12], device=device)  # one empty sequence
    total = 12
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(total, v, generator=g, dtype=torch.float64).to(device)
    labels = torch.randint(v, (total,), generator=g).to(device)
    labels[torch.tensor([0, 3, 8, 11])] = -100  # prompt-ish and each sequence's last token
    mask = mr.SamplingMask.from_lists([[y, (y + 5) % v] for y in labels[labels != -100].tolist()]).to(device)
    temp_seq = torch.tensor([0.5, 2.0, 1.5, 0.9], device=device)
    got = mr.replay_logprobs(logits, mask, labels, temp_seq, cu_seqlens=cu)
    temp_pos = torch.repeat_interleave(temp_seq, cu[1:] - cu[:-1])
    torch.testing.assert_close(got, reference(logits, mask, labels, temp_pos), rtol=0, atol=1e-12)
    # per-position temperature, and packed labels told apart by a loss_mask alone: same answer
    torch.testing.assert_close(mr.replay_logprobs(logits, mask, labels, temp_pos, loss_mask=labels != -100), got,
                               rtol=0, atol=0)
    z = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: mr.replay_logprobs(z, mask, labels, temp_seq, cu_seqlens=cu), (z,))


def test_per_sequence_and_per_position_temperature_3d():
    b, t, v = 3, 4, 9
    labels, mask = make_batch(b, t, v, seed=7)
    logits = torch.randn(b, t, v, dtype=torch.float64)
    per_seq = torch.tensor([0.5, 1.0, 2.0])
    per_pos = per_seq[:, None].expand(b, t)
    got = mr.replay_logprobs(logits, mask, labels, per_seq)
    torch.testing.assert_close(got, reference(logits, mask, labels, per_pos), rtol=0, atol=1e-12)
    torch.testing.assert_close(mr.replay_logprobs(logits, mask, labels, per_pos), got, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"temperature: expected a scalar, \[3\] \(one per sequence\)"):
        mr.replay_logprobs(logits, mask, labels, torch.ones(5))


def test_count_mismatch_names_both_counts():
    labels, mask = make_batch(2, 5, 8, seed=8)
    n = int((labels != -100).sum())
    short = mask.select_rows(0, n - 1)
    with pytest.raises(ValueError, match=f"the mask has {n - 1} rows but the batch has {n} positions"):
        mr.replay_logprobs(torch.randn(2, 5, 8), short, labels)


def test_errors_name_mask_row_and_position():
    b, t, v = 2, 4, 8
    labels = torch.tensor([[-100, 3, 4, 5], [1, 2, -100, 6]])
    rows = [[3], [4], [5, 7], [1], [2], [0, 1]]  # the last kept position's label 6 is outside
    mask = mr.SamplingMask.from_lists(rows)
    with pytest.raises(RuntimeError, match=re.escape("mask row 5 (batch 1, position 3)")):
        mr.replay_logprobs(torch.randn(b, t, v), mask, labels)
    lp, status = mr.replay_logprobs(torch.randn(b, t, v), mask, labels, fallback=True, return_status=True)
    assert status.tolist() == [[IGNORED, 0, 0, 0], [0, 0, IGNORED, FELL_BACK_OUTSIDE]]
    bad = labels.clone()
    bad[0, 1] = 9  # out of the vocabulary
    with pytest.raises(RuntimeError, match=re.escape("mask row 0 (batch 0, position 1)")):
        mr.replay_logprobs(torch.randn(b, t, v), mask, bad)
    with pytest.raises(ValueError, match=r"sampled must have shape \[2, 4\]"):
        mr.replay_logprobs(torch.randn(b, t, v), mask, labels[:, :3])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        mr.replay_logprobs(torch.randn(8, v), mask, labels.reshape(-1), cu_seqlens=torch.tensor([0, 3, 7]))


def test_non_finite_logits_at_ignored_positions_stay_out():
    """Padding rows may hold anything (-inf, NaN, +inf): the output and gradient stay clean."""
    b, t, v = 2, 4, 6
    labels, mask = make_batch(b, t, v, seed=9, ignore=0.5)
    logits = torch.randn(b, t, v, dtype=torch.float64)
    ign = labels == -100
    assert ign.any()
    specials = torch.tensor([float("-inf"), float("nan"), float("inf")], dtype=torch.float64)
    for i, (bb, tt) in enumerate(torch.nonzero(ign).tolist()):
        logits[bb, tt, :] = specials[i % 3]
    z = logits.clone().requires_grad_(True)
    lp = mr.replay_logprobs(z, mask, labels)
    assert torch.isfinite(lp).all() and (lp[ign] == 0).all()
    lp.sum().backward()
    assert torch.isfinite(z.grad).all() and (z.grad[ign] == 0).all()
    torch.testing.assert_close(lp, reference(logits, mask, labels), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_in_fp32_or_own_dtype_out(dtype):
    b, t, v = 3, 8, 500
    labels, mask = make_batch(b, t, v, seed=10, max_k=30)
    full = (torch.randn(b, t + 1, v, dtype=torch.float64) * 3).to(dtype)
    logits = full[:, :-1]
    truth = reference(logits, mask, labels)  # fp64 math on the same quantised logits
    got32 = mr.replay_logprobs(logits, mask, labels)
    assert got32.dtype == torch.float32
    assert (got32.double() - truth).abs().max() < 1e-5  # fp32 accumulation
    own = mr.replay_logprobs(logits, mask, labels, out_dtype=dtype)
    assert own.dtype == dtype
    torch.testing.assert_close(own, got32.to(dtype), rtol=0, atol=0)  # the fp32 result, rounded once
    z = full.clone().requires_grad_(True)
    mr.replay_logprobs(z[:, :-1], mask, labels, out_dtype=dtype).float().sum().backward()
    assert z.grad.dtype == dtype and torch.isfinite(z.grad.float()).all()
    assert (z.grad[:, -1] == 0).all()
    with pytest.raises(ValueError, match="out_dtype must be"):
        mr.replay_logprobs(logits, mask, labels, out_dtype=torch.int32)


def test_out_dtype_on_plain_rows():
    logits = torch.randn(4, 20).to(torch.bfloat16)
    mask = mr.SamplingMask.from_lists([[1, 2], [3], [4, 5, 6], [0, 19]])
    y = torch.tensor([2, 3, 6, 19])
    assert mr.replay_logprobs(logits, mask, y).dtype == torch.float32
    own = mr.replay_logprobs(logits, mask, y, out_dtype=torch.bfloat16)
    assert own.dtype == torch.bfloat16
    torch.testing.assert_close(own, mr.replay_logprobs(logits, mask, y).to(torch.bfloat16), rtol=0, atol=0)


# ---- align -------------------------------------------------------------------------------------------
def test_align_by_order_replays_a_shuffled_batch():
    b, t, v = 3, 5, 12
    labels, mask = make_batch(b, t, v, seed=11)
    logits = torch.randn(b, t, v, dtype=torch.float64)
    want = mr.replay_logprobs(logits, mask, labels)
    perm = torch.tensor([2, 0, 1])  # the trainer reorders its sequences
    # mask row of each position of the original batch (-1 where ignored)
    row_of = torch.full((b, t), -1)
    row_of[labels != -100] = torch.arange(mask.num_rows)
    aligned = mask.align(row_of[perm])
    got = mr.replay_logprobs(logits[perm], aligned, labels[perm])
    torch.testing.assert_close(got, want[perm], rtol=0, atol=0)
    assert aligned.num_rows == mask.num_rows and aligned.nnz == mask.nnz
    with pytest.raises(ValueError, match=f"names mask row {mask.num_rows} .* but the mask has {mask.num_rows} rows"):
        mask.align(torch.tensor([0, mask.num_rows]))


def test_align_by_sequence_ids_and_positions():
    # engine order: tokens of sequence 7 then 3, but the rows of 3 are stored with steps reversed
    rows = [[1], [2, 3], [4], [5, 6], [7]]
    seq = torch.tensor([7, 7, 3, 3, 3])
    position = torch.tensor([0, 1, 2, 1, 0])
    mask = mr.SamplingMask.from_lists(rows, sampled=torch.tensor([1, 2, 4, 5, 7]), sequence=seq, position=position)
    out = mask.align(sequences=torch.tensor([3, 7]))
    assert out.to_lists() == [[7], [5, 6], [4], [1], [2, 3]]
    assert out.sampled.tolist() == [7, 5, 4, 1, 2]
    assert out.extras["position"].tolist() == [0, 1, 2, 0, 1]
    assert out.extras["sequence"].tolist() == [3, 3, 3, 7, 7]
    with pytest.raises(ValueError, match="sequence 5 .* has no row in the mask"):
        mask.align(sequences=[3, 5])
    with pytest.raises(ValueError, match="no 'sequence' extra"):
        mr.SamplingMask.from_lists(rows).align(sequences=[0])
    with pytest.raises(ValueError, match="exactly one of"):
        mask.align()


# ---- property: any shape, slice, ignore pattern --------------------------------------------------
@given(b=st.integers(1, 4), t=st.integers(1, 6), v=st.integers(1, 9), seed=st.integers(0, 2**16),
       ignore=st.sampled_from([0.0, 0.5, 1.0]), cut=st.integers(0, 2))
def test_hypothesis_layouts(b, t, v, seed, ignore, cut):
    labels, mask = make_batch(b, t, v, seed=seed, ignore=ignore)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, t + cut, v, generator=g, dtype=torch.float64)
    logits = base[:, cut:]
    got = mr.replay_logprobs(logits, mask, labels)
    torch.testing.assert_close(got, reference(logits, mask, labels), rtol=0, atol=1e-12)
    z = base.clone().requires_grad_(True)
    mr.replay_logprobs(z[:, cut:], mask, labels).sum().backward()
    z2 = base.clone().requires_grad_(True)
    reference(z2[:, cut:], mask, labels).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad, rtol=0, atol=1e-12)


# ---- every stride pattern: gradient memory of the logits' own size (issue 48, item 8) ---------------
def backward_bytes(loss, z) -> tuple[int, torch.Tensor]:
    """(bytes the backward allocates, counted op by op from the profiler's memory records without
    their frees: an upper bound of its peak; the gradient of z). autograd.grad, not backward: a
    leaf's AccumulateGrad may copy a gradient to the leaf's strides, which is not replay's doing."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        (g,) = torch.autograd.grad(loss, z)
    total = 0
    for e in prof.events():
        own = e.cpu_memory_usage - sum(c.cpu_memory_usage for c in e.cpu_children)
        total += max(own, 0)
    return total, g


def strided_layouts(values, g):
    """The same [B, T, V] values over every order of a buffer's dims, each whole or sliced (a dim cut at
    both ends, or every other entry): the layouts permutations of buffers give (logits_bvt.transpose(1, 2)
    is order (0, 2, 1)). The buffer's other entries are noise."""
    b, t, v = values.shape
    cuts = {"whole": ((b, t, v), (slice(None),) * 3),
            "time_cut": ((b, t + 2, v), (slice(None), slice(1, 1 + t), slice(None))),
            "time_every_other": ((b, 2 * t, v), (slice(None), slice(None, 2 * t, 2), slice(None))),
            "vocab_every_other": ((b, t, 2 * v), (slice(None), slice(None), slice(None, 2 * v, 2))),
            "batch_cut": ((b + 2, t, v), (slice(1, 1 + b), slice(None), slice(None)))}
    for order in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)):
        for cut, (shape, index) in cuts.items():
            buffer = torch.randn(*(shape[d] for d in order), generator=g, dtype=values.dtype)
            logits = buffer.permute(tuple(order.index(d) for d in range(3)))[index]  # buffer dims back to B, T, V
            logits.copy_(values)
            yield f"{order}-{cut}", logits


def test_every_stride_pattern_has_a_gradient_of_the_logits_size():
    b, t, v = 2, 6, 256
    labels, mask = make_batch(b, t, v, seed=6)
    g = torch.Generator().manual_seed(7)
    values = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    w = torch.linspace(0.5, 1.5, b * t, dtype=torch.float64).reshape(b, t)
    z2 = values.clone().requires_grad_(True)
    want = reference(z2, mask, labels, 0.9)
    (want_grad,) = torch.autograd.grad((want * w).sum(), z2)
    for name, logits in strided_layouts(values, g):
        z = logits.detach().requires_grad_(True)  # the strides as they are
        got = mr.replay_logprobs(z, mask, labels, 0.9)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12, msg=name)
        used, grad = backward_bytes((got * w).sum(), z)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12, msg=name)
        # [B, V, T] transposed asked for a [(B - 1) * V * T + T, V] gradient: V times the logits here
        assert used <= 2 * logits.numel() * logits.element_size(), (name, used, _rows_of(z))
