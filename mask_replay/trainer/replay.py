"""Replay on the trainer side: log-probs of sampled tokens over their recorded support K.

    log pi_K(y) = x_y - logsumexp_{j in K} x_j,   x = logits / T

computed from the |K| gathered logits only (O(nnz), not O(N x V)), with gradients. Every op has a
fake kernel and its backward is itself a registered op (both in _register.py), so
torch.compile(fullgraph=True) traces forward and backward.

Fallback (``fallback=True``): a row whose sampled token is outside K, or whose K is empty, gets
the full-vocabulary log-prob instead of an error. ``return_status=True`` then also returns an
int8 tensor [N]: 0 replayed over K, 1 fell back because the sampled token was outside K,
2 fell back because K was empty.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from mask_replay._ops import FELL_BACK_EMPTY, FELL_BACK_OUTSIDE, REPLAYED, ops, reject_forward_ad
from mask_replay.mask import SamplingMask
from mask_replay.params import output_dtype, temperature_per_row
from mask_replay.trainer.layouts import replay_layout
from mask_replay.trainer.sparse_head import check_mask_arrays, replay_from_hidden_sparse

Temperature = Union[float, int, torch.Tensor]

__all__ = ["replay_logprobs", "replay_logprobs_from_hidden", "full_logprobs", "kept_mass",
           "REPLAYED", "FELL_BACK_OUTSIDE", "FELL_BACK_EMPTY"]


def _temperature(temperature: Temperature, n: int, device) -> torch.Tensor:
    """Per-row float32 [N] (> 0; tensor values are checked row by row in the kernels)."""
    return temperature_per_row(temperature, n, device, allow_zero=False)


def _rows_of(x: torch.Tensor, name: str, shape: str) -> int:
    """Rows of a 2-D input; anything else is named with the shape it must have."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape {shape}, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor of shape {shape}, got shape {tuple(x.shape)}")
    return x.shape[0]


def _sampled(sampled: Optional[torch.Tensor], mask: Optional[SamplingMask], n: int, device) -> torch.Tensor:
    if sampled is None:
        if mask is None or mask.sampled is None:
            raise ValueError("sampled is required (the mask carries no sampled tokens)")
        sampled = mask.sampled
        if tuple(sampled.shape) != (mask.num_rows,):  # the mask itself is malformed (SamplingMask.validate says so)
            raise ValueError(f"mask.sampled has shape {tuple(sampled.shape)} but the mask has {mask.num_rows} rows")
        if sampled.shape[0] != n:  # the caller passed no sampled: the mask is the misfit
            raise ValueError(f"the mask has {mask.num_rows} rows but there are {n} rows of logits "
                             f"(sampled defaults to mask.sampled)")
    if not isinstance(sampled, torch.Tensor) or sampled.dim() != 1 or sampled.shape[0] != n:
        shape = tuple(sampled.shape) if isinstance(sampled, torch.Tensor) else type(sampled).__name__
        raise ValueError(f"sampled must be a tensor of shape [{n}], got {shape}")
    if sampled.is_floating_point() or sampled.is_complex() or sampled.dtype == torch.bool:
        raise ValueError(f"sampled must hold integer token ids, got {sampled.dtype}")
    return sampled.to(device=device, dtype=torch.int64).contiguous()


def _mask_tensors(mask: SamplingMask, device, op: str):
    check_mask_arrays(mask, op)  # dtypes, shapes, data: one error naming the array before the kernel runs
    # A mask loaded from disk lives on the CPU while the logits are on the GPU; it is O(nnz).
    return mask.token_ids.to(device), mask.offsets.to(device)


def replay_logprobs(
    logits: torch.Tensor,
    mask: SamplingMask,
    sampled: Optional[torch.Tensor] = None,
    temperature: Temperature = 1.0,
    *,
    fallback: bool = False,
    return_status: bool = False,
    ignore_index: int = -100,
    loss_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Log-prob of ``sampled`` under softmax(logits / T) renormalised over each row's support.

    logits [N, V] float32/bfloat16/float16 (float64 for gradcheck), any strides; mask a
    SamplingMask of N rows; sampled [N] int (defaults to ``mask.sampled``); temperature a scalar or
    a per-row tensor [N]. Returns float32 [N] (float64 for float64 logits), differentiable w.r.t.
    logits; with ``return_status`` returns ``(logp, status)`` (see the module docstring).
    A row with |K| = 1 gives 0 and a zero gradient.

    Trainer layouts (layouts.py): logits [B, T, V] with sampled [B, T], or packed logits
    [total_tokens, V] with sampled [total_tokens] and ``cu_seqlens`` [S + 1] (or a loss_mask). A
    position is ignored when its label equals ``ignore_index`` or, if given, ``loss_mask`` is 0
    there; the mask has one row per kept position, in row-major order (``mask.align`` maps another
    order), and a different count is an error naming both. The result has the labels' shape, 0 at
    ignored positions (gradient 0 there), status -1 there. temperature: a scalar, one per sequence
    ([B], or [S] with cu_seqlens) or one per position. The logits are never copied (except for
    layouts that no strided view can address, e.g. overlapping strides). With loss_mask, sampled
    may be None: the labels of kept positions are then ``mask.sampled``.

    out_dtype: None gives float32 (float64 for float64 logits), accumulated in float32 whatever the
    input; ``logits.dtype`` rounds the result to the logits' own dtype (e.g. bfloat16).
    """
    # Decided from arguments only (no look at the values): torch.compile traces either path whole.
    # A non-tensor is named here: the dispatch below and replay_layout call logits.dim() before
    # _rows_of can name it (an AttributeError otherwise).
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a tensor of shape [N, V] or [B, T, V], got {type(logits).__name__}")
    reject_forward_ad("mask_replay::replay_fwd", logits)
    if logits.dim() == 3 or cu_seqlens is not None or loss_mask is not None:
        return replay_layout(logits, mask, sampled, temperature, ignore_index=ignore_index, loss_mask=loss_mask,
                             cu_seqlens=cu_seqlens, fallback=fallback, return_status=return_status,
                             out_dtype=out_dtype)
    out = output_dtype(out_dtype, logits.dtype, "replay_logprobs")
    n = _rows_of(logits, "logits", "[N, V]")
    ids, offsets = _mask_tensors(mask, logits.device, "replay_logprobs")
    y = _sampled(sampled, mask, n, logits.device)
    t = _temperature(temperature, n, logits.device)
    logp, _, status = ops.replay_fwd(logits, ids, offsets, y, t, bool(fallback))
    logp = logp.to(out)
    return (logp, status) if return_status else logp


def replay_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mask: SamplingMask,
    sampled: Optional[torch.Tensor] = None,
    temperature: Temperature = 1.0,
    bias: Optional[torch.Tensor] = None,
    *,
    fallback: bool = False,
    return_status: bool = False,
    sparse_grad: bool = False,
    out_dtype: Optional[torch.dtype] = None,
):
    """replay_logprobs(hidden @ weight.T + bias, ...) without the [N, V] projection.

    hidden [N, d], weight [V, d] (the LM head), bias [V] or None, all of one dtype. Logits are
    computed only for the tokens of K, in forward and backward (O(nnz x d)); gradients flow to
    hidden, weight (only rows in K are non-zero) and bias. Fallback rows need the full projection
    of their own row (done densely for those rows only).

    sparse_grad=True (sparse_head.py): the weight gradient is a sparse COO tensor [V, d] holding
    only the support's rows, as nn.Embedding(sparse=True) gives, O(nnz x d) instead of a dense
    [V, d] write; added in place into an existing dense ``weight.grad``. A fallback row's softmax
    covers the whole vocabulary, so with fallback rows the sparse gradient has all V rows.
    out_dtype as in replay_logprobs.
    """
    reject_forward_ad("mask_replay::hidden_fwd", hidden, weight, bias)
    if sparse_grad:
        return replay_from_hidden_sparse(hidden, weight, mask, sampled, temperature, bias, fallback=fallback,
                                         return_status=return_status, out_dtype=out_dtype)
    n = _rows_of(hidden, "hidden", "[N, d]")  # first: output_dtype reads hidden.dtype
    out = output_dtype(out_dtype, hidden.dtype, "replay_logprobs_from_hidden")
    _rows_of(weight, "weight", "[V, d]")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor of shape [V] or None, got {type(bias).__name__}")
    ids, offsets = _mask_tensors(mask, hidden.device, "replay_logprobs_from_hidden")
    y = _sampled(sampled, mask, n, hidden.device)
    t = _temperature(temperature, n, hidden.device)
    b = bias if bias is not None else hidden.new_empty((0,))
    logp, _, status = ops.hidden_fwd(hidden, weight, b, ids, offsets, y, t, bool(fallback))
    logp = logp.to(out)
    return (logp, status) if return_status else logp


def full_logprobs(logits: torch.Tensor, sampled: torch.Tensor, temperature: Temperature = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[sampled] over the whole vocabulary (the no-replay baseline), one
    pass over each row, differentiable w.r.t. logits."""
    reject_forward_ad("mask_replay::full_fwd", logits)
    n = _rows_of(logits, "logits", "[N, V]")
    y = _sampled(sampled, None, n, logits.device)
    t = _temperature(temperature, n, logits.device)
    logp, _ = ops.full_fwd(logits, y, t)
    return logp


def kept_mass(logits: torch.Tensor, mask: SamplingMask, temperature: Temperature = 1.0) -> torch.Tensor:
    """exp(logsumexp_K x - logsumexp_V x): the probability mass the support keeps under the full
    temperature-scaled distribution (0 for an empty row). Not differentiable."""
    n = _rows_of(logits, "logits", "[N, V]")
    ids, offsets = _mask_tensors(mask, logits.device, "kept_mass")
    return ops.kept_mass(logits, ids, offsets, _temperature(temperature, n, logits.device))
