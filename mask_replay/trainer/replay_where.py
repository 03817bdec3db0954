"""Replay on some rows, the trainer's own full-vocabulary log-probs on the others, in one gradient.

A trainer integration (verl's engine, for one) computes its own log-probs over the whole vocabulary on
every row, and replay must replace them only where a support was recorded: elsewhere (prompt positions,
tokens nobody recorded, whole-vocabulary rows) the trainer's value must stay bit for bit. Doing that
with ``torch.where(keep, replay_logprobs(...), own)`` pays two dense [N, V] gradients (the trainer's
softmax gradient on every row, replay's zeros-and-support on every row) and their sum. Here the
trainer's values are taken without a graph and one backward writes each row once: the support's
gradient on replayed rows, the full softmax gradient (from the logsumexp implied by the trainer's own
value, or recomputed when that value is too coarse) on the others.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay._ops import FELL_BACK_EMPTY, REPLAYED, ops, refuse_double_backward, reject_forward_ad
from mask_replay.csr import check_offsets
from mask_replay.errors import InputError, OutsideSupportError
from mask_replay.mask import SamplingMask
from mask_replay.params import temperature_per_row
from mask_replay.trainer.sparse_head import check_mask_arrays

__all__ = ["replay_where"]

IGNORED = -1  # row status whose gradient the backward leaves at zero


def _all_rows_csr(mask: SamplingMask, keep: torch.Tensor, sampled: torch.Tensor, derive: bool):
    """The mask's rows at the kept positions; every other row is the sampled token alone (derive: its
    logsumexp comes from the trainer's value) or empty (the kernel falls back and computes it)."""
    n = keep.numel()
    device = keep.device
    lengths = torch.ones(n, dtype=torch.int64, device=device) if derive else torch.zeros(n, dtype=torch.int64,
                                                                                         device=device)
    kept = torch.nonzero(keep).flatten()
    mask_lengths = mask.offsets.diff().to(device)
    lengths[kept] = mask_lengths
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.empty(int(offsets[-1]), dtype=torch.int32, device=device)
    if derive:
        others = torch.nonzero(~keep).flatten()
        ids[offsets[others]] = sampled[others].to(torch.int32)
    entry_row = torch.repeat_interleave(kept, mask_lengths, output_size=mask.nnz)
    within = torch.arange(mask.nnz, device=device) - torch.repeat_interleave(mask.offsets[:-1].to(device),
                                                                             mask_lengths, output_size=mask.nnz)
    ids[offsets[entry_row] + within] = mask.token_ids.to(device)
    return ids, offsets


class _ReplayWhere(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, own, keep, ids, offsets, sampled, temperature, derive):
        logp, lse, status = ops.replay_fwd(logits, ids, offsets, sampled, temperature, not derive)
        if not derive:  # fallback was on for the unkept (empty) rows only: a kept row must have replayed
            outside = torch.nonzero(keep & (status != REPLAYED))
            if outside.numel():
                r = int(outside[0, 0])
                raise OutsideSupportError(f"row {r}: the sampled token {int(sampled[r])} is not in its support",
                                          row=r)
        if derive:
            x_y = logits.gather(1, sampled[:, None])[:, 0].to(lse.dtype) / temperature.to(lse.dtype)
            implied = x_y - own.to(lse.dtype)
            lse = torch.where(keep, lse, implied)
            fell_back = torch.where(torch.isfinite(implied), FELL_BACK_EMPTY, IGNORED).to(status.dtype)
            status = torch.where(keep, status, fell_back)
        ctx.save_for_backward(logits, ids, offsets, sampled, temperature, lse, status)
        return torch.where(keep, logp.to(own.dtype), own)

    @staticmethod
    def backward(ctx, grad):
        logits, ids, offsets, sampled, temperature, lse, status = ctx.saved_tensors
        g = ops.replay_bwd(grad.to(lse.dtype).contiguous(), logits, ids, offsets, sampled, temperature, lse, status)
        (g,) = refuse_double_backward("mask_replay::replay_where", (g,), logits)
        return g, None, None, None, None, None, None, None


def replay_where(keep: torch.Tensor, logits: torch.Tensor, mask: SamplingMask, sampled: torch.Tensor,
                 own: torch.Tensor, temperature: float = 1.0, *, mask_sampled: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """log pi_K(sampled) where ``keep``, the trainer's ``own`` full-vocabulary log-prob elsewhere.

    keep bool [N]; logits [N, V] (differentiable); mask a SamplingMask with one row per True of keep, in
    row order; sampled int [N] the labels of every row; own [N] the trainer's log-probs of ``sampled``
    over the whole vocabulary at the same temperature, computed without a graph (detached here), returned
    bit for bit where keep is False, whose gradient there is the full softmax gradient. The result has
    own's dtype. own in float32 / float64: the logsumexp of an unkept row is x_y - own (no second pass
    over the row); in a coarser dtype the kernel recomputes it. A row whose own value is not finite gets
    a zero gradient.
    """
    for name, t in (("keep", keep), ("logits", logits), ("sampled", sampled), ("own", own)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    reject_forward_ad("mask_replay::replay_where", logits)
    if logits.dim() != 2:
        raise InputError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    for name, t in (("keep", keep), ("sampled", sampled), ("own", own)):
        if tuple(t.shape) != (n,):
            raise InputError(f"{name} must have shape [{n}] (one per row of logits), got {tuple(t.shape)}")
    if keep.dtype != torch.bool:
        raise InputError(f"keep must be a bool tensor, got {keep.dtype}")
    if sampled.is_floating_point() or sampled.is_complex() or sampled.dtype == torch.bool:
        raise InputError(f"sampled must hold integer token ids, got {sampled.dtype}")
    if not own.is_floating_point():
        raise InputError(f"own must hold floating-point log-probs, got {own.dtype}")
    check_mask_arrays(mask, "replay_where")
    check_offsets(mask.offsets, mask.nnz, source="replay_where: mask")
    kept = int(keep.sum())
    if mask.num_rows != kept:
        raise InputError(f"the mask has {mask.num_rows} rows but keep marks {kept}")
    device = logits.device
    keep, sampled, own = keep.to(device), sampled.to(device=device, dtype=torch.int64), own.detach().to(device)
    if mask_sampled is not None and not torch.equal(mask_sampled.to(device, torch.int64), sampled[keep]):
        raise InputError("the mask's sampled tokens differ from sampled at the kept rows")
    derive = own.dtype in (torch.float32, torch.float64)
    ids, offsets = _all_rows_csr(mask, keep, sampled, derive)
    t = temperature_per_row(temperature, n, device, allow_zero=False)
    return _ReplayWhere.apply(logits, own, keep, ids, offsets, sampled, t, derive)
