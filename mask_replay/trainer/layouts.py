"""The trainer's batch layouts for replay: [B, T, V] logits with [B, T] labels, and packed
sequences ([total_tokens, V] with cu_seqlens).

A trainer keeps ignored positions (prompt, padding, the last token of a sequence) in its batch;
the mask has one row per *kept* position, in row-major order (the order a trainer flattens them
and the engine adapters produce). The common layouts are not copied: the positions are addressed as
rows of a 2-D strided view of the logits' own memory ("cover rows"; a layout no such view can
address without overlapping rows, or without twice as many rows as positions, is copied once, as
the gradient of such a view would be far larger than the logits), and every row of that view
that is not a kept position gets a one-token dummy support, whose log-prob is 0 and whose
gradient is 0. The replay op then runs once over the view, O(nnz + rows).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from mask_replay._ops import ops
from mask_replay.params import ignore_index_value, output_dtype, temperature_value
from mask_replay.trainer.sparse_head import check_mask_arrays

IGNORED = -1  # status of a position without a mask row (replay's own codes are 0, 1, 2)


# ---- positions as rows of one strided 2-D view ---------------------------------------------------
@dataclass(frozen=True)
class _Rows:
    """How positions (b, t) map to rows of a 2-D [count, V] view: row = b * k0 + t * k1.

    kind: "flat" (2-D logits, row = position), "view" (logits.view(B * T, V)), "strided" (an
    as_strided view over memory the logits already span, e.g. logits[:, :-1] of a contiguous
    tensor: it holds a few rows that are no position; only where its rows do not overlap and are
    at most twice the positions, see _addressable), "copy" (any other layout, e.g. a [B, V, T]
    buffer transposed to [B, T, V]: copied once, [B * T, V], the gradient the same size).
    """
    kind: str
    k0: int
    k1: int
    stride: int
    count: int

    def view(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kind == "flat":
            return logits
        v = logits.shape[-1]
        if self.kind == "strided":
            # no storage_offset argument: as_strided keeps the input's own (and torch.compile traces it)
            return logits.as_strided((self.count, v), (self.stride, logits.stride(2)))
        return logits.reshape(self.count, v)  # a view for "view", the one copy for "copy"

    def unview(self, grad_rows: torch.Tensor, shape) -> torch.Tensor:
        """The gradient of the logits from the gradient of the rows: a view, never a copy."""
        if self.kind == "strided":
            v = shape[-1]
            return grad_rows.as_strided(tuple(shape), (self.k0 * v, self.k1 * v, 1))
        return grad_rows.view(shape)

    def positions(self, shape, device) -> torch.Tensor:
        """Row of every position, row-major over the batch (int64 [P])."""
        if self.kind == "flat":
            return torch.arange(shape[0], device=device)
        b, t = shape[0], shape[1]
        return (torch.arange(b, device=device)[:, None] * self.k0
                + torch.arange(t, device=device)[None, :] * self.k1).reshape(-1)


def _rows_of(logits: torch.Tensor) -> _Rows:
    if logits.dim() == 2:
        return _Rows("flat", 1, 0, 0, logits.shape[0])
    b, t, v = logits.shape
    try:
        logits.view(b * t, v)
        return _Rows("view", t, 1, 0, b * t)
    except RuntimeError:
        pass
    s0, s1 = logits.stride(0), logits.stride(1)
    candidates = []
    # Batch outer (logits[:, a:c] of a [B, T', V] tensor): rows every s1, B blocks s0 // s1 apart.
    if s1 > 0 and s0 % s1 == 0 and s0 // s1 >= t:
        candidates.append(_Rows("strided", s0 // s1, 1, s1, (b - 1) * (s0 // s1) + t))
    # Time outer (a [T, B, V] tensor transposed to [B, T, V]).
    if s0 > 0 and s1 % s0 == 0 and s1 // s0 >= b:
        candidates.append(_Rows("strided", 1, s1 // s0, s0, (t - 1) * (s1 // s0) + b))
    for rows in candidates:
        if _addressable(rows, v, logits.stride(2), b * t):
            return rows
    return _Rows("copy", t, 1, 0, b * t)


def _addressable(rows: _Rows, v: int, s2: int, positions: int) -> bool:
    """Whether the [count, V] view of ``rows`` may stand for the positions: its rows must not overlap
    (the backward writes a [count, V] gradient: overlapping rows, e.g. a [B, V, T] buffer transposed
    to [B, T, V], whose row starts lie one element apart, would make count ~ B * T * V), and it must
    hold at most as many rows as twice the positions (every other row is a dummy whose gradient is
    written too: beyond that the one copy, [positions, V], and its gradient cost less)."""
    if rows.count > 2 * positions:
        return False
    dims = sorted((stride, size) for stride, size in ((rows.stride, rows.count), (s2, v)) if size > 1)
    if any(stride <= 0 for stride, _ in dims):
        return False
    return len(dims) < 2 or dims[1][0] >= dims[0][0] * dims[0][1]  # the larger stride clears the smaller dim


class _RowsReplay(torch.autograd.Function):
    """replay_fwd / replay_bwd over the rows view; the gradient goes back as a view of the op's
    [rows, V] output, so the backward writes the dense gradient once."""

    @staticmethod
    def forward(ctx, logits, rows_map, token_ids, offsets, sampled, temperature, fallback, dummy_rows):
        rows = rows_map.view(logits)
        logp, lse, status = ops.replay_fwd(rows, token_ids, offsets, sampled, temperature, fallback)
        ctx.save_for_backward(logits, rows, token_ids, offsets, sampled, temperature, lse, status, dummy_rows)
        ctx.rows_map, ctx.shape = rows_map, logits.shape
        ctx.mark_non_differentiable(status)
        return logp, status

    @staticmethod
    def backward(ctx, grad_logp, _grad_status):
        logits, rows, token_ids, offsets, sampled, temperature, lse, status, dummy_rows = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the rows view is taken again from the logits so that the gradient
            # stays connected to them, and differentiating it reaches replay_bwd's refusal (_ops.py)
            # instead of a silent zero.
            rows = ctx.rows_map.view(logits)
        grad = ops.replay_bwd(grad_logp.contiguous(), rows, token_ids, offsets, sampled, temperature, lse, status)
        # A dummy row's gradient is 0 (support {0}, label 0), or NaN where its token-0 logit is not
        # finite (lse = +-inf or NaN): every dummy row is zeroed in place, which is the same where
        # finite and costs no [dummies, V] gather nor a second [rows, V] buffer (the gradient is
        # replay_bwd's own fresh output). No data-dependent branch or shape: torch.compile traces it whole.
        grad = grad.index_fill_(0, dummy_rows, 0)
        return ctx.rows_map.unview(grad, ctx.shape), None, None, None, None, None, None, None


# ---- the batch's positions ------------------------------------------------------------------------
def _check_cu_seqlens(cu_seqlens, total: int, device) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [S + 1]")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at the number of tokens ({total}), "
                         f"got {cu_seqlens.tolist() if cu_seqlens.numel() <= 8 else '[...]'}")
    return cu


def _position_temperature(temperature, shape, cu: Optional[torch.Tensor], device) -> torch.Tensor:
    """float32 per position (same shape as the labels) from a scalar, a per-sequence tensor
    ([B], or [S] with cu_seqlens) or a per-position tensor."""
    value = temperature_value(temperature)
    if not isinstance(value, torch.Tensor):
        return torch.full(shape, value, dtype=torch.float32, device=device)
    t = value.to(device=device, dtype=torch.float32)
    if t.dim() == 0:
        return t.expand(shape)
    if cu is not None and t.shape == (cu.numel() - 1,):
        return torch.repeat_interleave(t, cu[1:] - cu[:-1], output_size=shape[0])
    if len(shape) == 2 and t.shape == (shape[0],):
        return t[:, None].expand(shape)
    if tuple(t.shape) == tuple(shape):
        return t
    per_seq = f"[{cu.numel() - 1}]" if cu is not None else (f"[{shape[0]}]" if len(shape) == 2 else None)
    raise ValueError(f"temperature: expected a scalar, {per_seq + ' (one per sequence), ' if per_seq else ''}"
                     f"or {list(shape)} (one per position), got {tuple(t.shape)}")


def _keep(sampled, loss_mask, ignore_index, shape, device) -> torch.Tensor:
    keep = torch.ones(shape, dtype=torch.bool, device=device)
    if sampled is not None:
        keep &= sampled != ignore_index_value(ignore_index)
    if loss_mask is not None:
        if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != tuple(shape):
            got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
            raise ValueError(f"loss_mask must have the labels' shape {list(shape)}, got {got}")
        keep &= loss_mask.to(device) != 0
    return keep.reshape(-1)


def _describe(position: int, shape, cu: Optional[torch.Tensor]) -> str:
    if len(shape) == 2:
        return f"batch {position // shape[1]}, position {position % shape[1]}"
    if cu is not None:
        s = int(torch.searchsorted(cu.cpu(), torch.tensor(position), right=True)) - 1
        return f"token {position}, sequence {s}"
    return f"token {position}"


# ---- the layout step, one op -----------------------------------------------------------------------
# Which positions are kept, and so how many rows the mask must have and how long the CSR over the view
# is, depends on the labels' values. As a custom op (with a fake kernel whose sizes are unbacked
# symbols), that step is opaque to torch.compile, and replay over [B, T, V] or packed layouts traces
# whole (fullgraph=True) like the 2-D path; its checks run inside it, in eager and compiled code alike.
@torch.library.custom_op("mask_replay::layout_csr", mutates_args=())
def _layout_csr(keep: torch.Tensor, pos_rows: torch.Tensor, rows: int, token_ids: torch.Tensor,
                offsets: torch.Tensor, labels: torch.Tensor, mask_sampled: torch.Tensor, labels_from_mask: bool,
                temperature: torch.Tensor, cu_seqlens: torch.Tensor, total: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, offsets, labels, temperatures over the view's rows; the dummy rows; the kept positions)."""
    if cu_seqlens.numel():
        _check_cu_seqlens(cu_seqlens, total, cu_seqlens.device)
    kept_pos = torch.nonzero(keep)[:, 0]
    n, m = kept_pos.numel(), offsets.numel() - 1
    if m != n:
        raise ValueError(f"replay_logprobs: the mask has {m} rows but the batch has {n} positions "
                         f"that are not ignored (mask.align(...) maps another order)")
    y_kept = mask_sampled.to(torch.int64) if labels_from_mask else labels[kept_pos]
    out = _rows_csr(token_ids, offsets, pos_rows[kept_pos], rows, y_kept, temperature[kept_pos])
    return out + (kept_pos,)


@_layout_csr.register_fake
def _layout_csr_fake(keep, pos_rows, rows, token_ids, offsets, labels, mask_sampled, labels_from_mask,
                     temperature, cu_seqlens, total):
    ctx = torch.library.get_ctx()
    dummies, kept = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (token_ids.new_empty((token_ids.shape[0] + dummies,)), offsets.new_empty((rows + 1,)),
            labels.new_empty((rows,)), temperature.new_empty((rows,)), offsets.new_empty((dummies,)),
            offsets.new_empty((kept,)))


def _rows_csr(token_ids, m_off, kept_rows, r: int, y_kept, t_kept):
    """The CSR over every row of the view: the mask's rows at kept positions, {0} (label 0,
    temperature 1: log-prob 0, gradient 0) at every other row. O(nnz + rows)."""
    device = kept_rows.device
    n, nnz = kept_rows.numel(), token_ids.numel()
    m_len = m_off[1:] - m_off[:-1]
    if bool((m_len < 0).any()) or int(m_off[0]) != 0 or int(m_off[-1]) != nnz:
        raise ValueError("replay_logprobs: the mask's offsets are not a valid CSR (see SamplingMask.validate)")
    lengths = torch.ones(r, dtype=torch.int64, device=device)
    lengths[kept_rows] = m_len
    offsets = torch.zeros(r + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.zeros(int(offsets[-1]), dtype=torch.int32, device=device)
    if nnz:
        m_rows = torch.repeat_interleave(torch.arange(n, device=device), m_len, output_size=nnz)
        dest = offsets[kept_rows][m_rows] + torch.arange(nnz, device=device) - m_off[m_rows]
        ids[dest] = token_ids.to(device=device, dtype=torch.int32)
    y = torch.zeros(r, dtype=torch.int64, device=device)
    y[kept_rows] = y_kept
    t = torch.ones(r, dtype=torch.float32, device=device)
    t[kept_rows] = t_kept
    is_dummy = torch.ones(r, dtype=torch.bool, device=device)
    is_dummy[kept_rows] = False
    return ids, offsets, y, t, torch.nonzero(is_dummy)[:, 0]


def replay_layout(logits, mask, sampled, temperature, *, ignore_index=-100, loss_mask=None, cu_seqlens=None,
                  fallback=False, return_status=False, out_dtype=None):
    """replay_logprobs over a trainer batch; see replay.replay_logprobs for the contract."""
    check_mask_arrays(mask, "replay_logprobs")  # the layout op would cast float or int64 ids to int32 silently
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, T, V] or packed [total_tokens, V], got {logits.dim()}-D")
    if logits.dim() == 3 and cu_seqlens is not None:
        raise ValueError("cu_seqlens is for packed [total_tokens, V] logits, not [B, T, V]")
    device = logits.device
    shape = tuple(logits.shape[:-1])
    if sampled is not None:
        if not isinstance(sampled, torch.Tensor) or tuple(sampled.shape) != shape:
            got = tuple(sampled.shape) if isinstance(sampled, torch.Tensor) else type(sampled).__name__
            raise ValueError(f"sampled must have shape {list(shape)} (one label per position), got {got}")
        if sampled.is_floating_point() or sampled.is_complex() or sampled.dtype == torch.bool:
            raise ValueError(f"sampled must hold integer token ids, got {sampled.dtype}")
    elif loss_mask is None:
        raise ValueError("sampled (labels with ignore_index) or loss_mask is required to place the mask's rows")
    out = output_dtype(out_dtype, logits.dtype, "replay_logprobs")
    cu = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.dim() != 1:
            _check_cu_seqlens(cu_seqlens, shape[0], device)  # names what is wrong with it
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        if not torch.compiler.is_compiling():  # first, as before; compiled, the layout op checks it
            _check_cu_seqlens(cu, shape[0], device)
    if sampled is None and mask.sampled is None:
        raise ValueError("sampled is required (the mask carries no sampled tokens)")

    keep = _keep(sampled, loss_mask, ignore_index, shape, device)
    if sampled is not None:
        labels = sampled.reshape(-1).to(torch.int64)
    else:
        labels = keep.new_zeros(keep.shape, dtype=torch.int64)
    mask_sampled = mask.sampled.to(device=device, dtype=torch.int64) if sampled is None else labels.new_zeros(0)
    t_pos = _position_temperature(temperature, shape, cu, device).reshape(-1)

    rows_map = _rows_of(logits)
    pos_rows = rows_map.positions(shape, device)
    ids, offsets, y, t, dummy_rows, kept_pos = ops.layout_csr(
        keep, pos_rows, rows_map.count, mask.token_ids.to(device), mask.offsets.to(device=device, dtype=torch.int64),
        labels, mask_sampled, sampled is None, t_pos.contiguous(),
        cu if cu is not None else labels.new_zeros(0), shape[0])

    try:
        logp_rows, status_rows = _RowsReplay.apply(logits, rows_map, ids, offsets, y, t, bool(fallback), dummy_rows)
    except RuntimeError as exc:
        raise _translate(exc, pos_rows[kept_pos], kept_pos, shape, cu) from None

    keep_shaped = keep.reshape(shape)
    at_pos = logp_rows[pos_rows].reshape(shape)
    logp = torch.where(keep_shaped, at_pos, torch.zeros((), dtype=at_pos.dtype, device=device)).to(out)
    if not return_status:
        return logp
    status = torch.where(keep_shaped, status_rows[pos_rows].reshape(shape),
                         torch.full((), IGNORED, dtype=torch.int8, device=device))
    return logp, status


def _translate(exc: RuntimeError, kept_rows, kept_pos, shape, cu):
    """The op names rows of the view; the user knows mask rows and batch positions."""
    rows = kept_rows.cpu().tolist()
    index = {row: i for i, row in enumerate(rows)}
    pos = kept_pos.cpu().tolist()

    def name(m):
        row = int(m.group(1))
        if row not in index:
            return m.group(0)
        i = index[row]
        return f"mask row {i} ({_describe(pos[i], shape, cu)})"

    msg = str(exc).splitlines()[0] if str(exc) else repr(exc)
    return type(exc)(re.sub(r"\brow (\d+)", name, msg))
