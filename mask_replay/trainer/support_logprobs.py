"""The replayed log-prob of every support entry, O(nnz), with gradients: the trainer's side of a mask's
`entry_logprobs`, and what losses over the whole support (score centering, trainer/losses.py) consume.

    out_e = x_e - logsumexp_{j in S(row e)} x_j,   x = logits / T,   e over the mask's CSR entries

The result is float32 [nnz] (float64 for float64 logits), aligned with ``mask.token_ids``. It is a
composition of torch ops over the gathered support logits: one gather of the nnz logits, segment
reductions in float64 (csr.support_log_softmax), no pass over the [N, V] logits beyond the gather and
the one dense write of their gradient that any loss on [N, V] logits pays. That is why there is no
C++ kernel for it: a kernel pays off where the composition would read [N, V] again, which this one
never does. Being torch ops only, it traces under torch.compile(fullgraph=True) (the [N, V] path
and the sparse LM head without sparse_grad; tests/trainer/test_support_logprobs.py checks compiled ==
eager): the mask and temperature checks read values back to the host, so they run in eager mode
only; under compilation the mask is taken as valid, so validate it once, e.g. with
``mask.validate(vocab_size)``.

Layouts, as replay_logprobs takes them: logits [N, V] (one mask row per row); [B, T, V] with labels
[B, T] (ignore_index, and/or loss_mask, marks positions without a mask row; the mask has one row per
kept position, row-major); packed [total, V] with labels [total] and optionally cu_seqlens (used for
a per-sequence temperature). From hidden states: the sparse LM head (sparse_head.support_logits),
never an [N, V] tensor, with a sparse COO weight gradient under ``sparse_grad=True``.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay.csr import support_log_softmax
from mask_replay.mask import SamplingMask
from mask_replay.params import compute_dtype, output_dtype, temperature_per_row
from mask_replay.trainer.layouts import _check_cu_seqlens, _keep, _position_temperature
from mask_replay.trainer.sparse_head import check_head, check_mask_arrays, mask_csr, support_logits

__all__ = ["replay_support_logprobs", "replay_support_logprobs_from_hidden", "support_logprobs_padded"]


def _kept_positions(op, shape, labels, loss_mask, ignore_index, device) -> torch.Tensor:
    """Flat indices of the positions that have a mask row (row-major)."""
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(shape):
            got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(f"{op}: labels must have shape {list(shape)} (one per position), got {got}")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"{op}: labels must hold integer token ids, got {labels.dtype}")
        labels = labels.to(device)
    elif loss_mask is None:
        raise ValueError(f"{op}: [B, T, V] or packed logits need labels (with ignore_index) or loss_mask "
                         "to place the mask's rows")
    return torch.nonzero(_keep(labels, loss_mask, ignore_index, shape, device))[:, 0]


def replay_support_logprobs(
    logits: torch.Tensor,
    mask: SamplingMask,
    labels: Optional[torch.Tensor] = None,
    *,
    temperature=1.0,
    ignore_index: int = -100,
    loss_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """log softmax(logits / T) renormalised over each row's support, for every support entry.

    Returns [nnz] aligned with ``mask.token_ids`` (float32; float64 for float64 logits; out_dtype as
    in replay_logprobs), differentiable w.r.t. the logits: the gradient is zero outside the support
    and, for a row with |S| = 1, zero everywhere (its one entry is 0). An entry whose logit is -inf
    gives -inf. ``labels`` only place the mask's rows in [B, T, V] / packed logits (any label other
    than ``ignore_index`` is a kept position); temperature: a scalar, one per mask row ([N] for
    [N, V] logits), or as replay_logprobs takes it in the batch layouts (per sequence [B] or [S]
    with cu_seqlens, or per position).
    """
    op = "replay_support_logprobs"
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        raise ValueError(f"{op}: logits must be a tensor [N, V], [B, T, V] or packed [total, V]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{op}: logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    out = output_dtype(out_dtype, logits.dtype, op)
    acc = compute_dtype(logits.dtype)
    device, vocab = logits.device, logits.shape[-1]
    batch = logits.dim() == 3 or labels is not None or loss_mask is not None or cu_seqlens is not None
    if not batch:
        n = logits.shape[0]
        ids, _, rows = mask_csr(mask, n, vocab, device, op)
        t = temperature_per_row(temperature, n, device, allow_zero=False, op=op,
                                check_values=not torch.compiler.is_compiling())
        x = logits[rows, ids].to(acc) / t.to(acc)[rows]
        return support_log_softmax(x, rows, n).to(out)

    if logits.dim() == 3 and cu_seqlens is not None:
        raise ValueError(f"{op}: cu_seqlens is for packed [total_tokens, V] logits, not [B, T, V]")
    shape = tuple(logits.shape[:-1])
    cu = _check_cu_seqlens(cu_seqlens, shape[0], device) if cu_seqlens is not None else None
    kept = _kept_positions(op, shape, labels, loss_mask, ignore_index, device)
    n = kept.numel()
    check_mask_arrays(mask, op)  # before its row count is read
    if mask.num_rows != n:
        raise ValueError(f"{op}: the mask has {mask.num_rows} rows but the batch has {n} positions that are not "
                         "ignored (mask.align(...) maps another order)")
    ids, _, rows = mask_csr(mask, n, vocab, device, op)
    t = _position_temperature(temperature, shape, cu, device).reshape(-1)[kept]
    bad = ~(torch.isfinite(t) & (t > 0))
    if n and bool(bad.any()):
        r = int(torch.nonzero(bad)[0])
        raise ValueError(f"{op}: temperature must be finite and > 0, mask row {r} has {float(t[r])}")
    pos = kept[rows]
    # Advanced indexing on the logits themselves (any strides, no copy); autograd scatters the
    # gradient back into their shape.
    index = (pos // shape[1], pos % shape[1], ids) if logits.dim() == 3 else (pos, ids)
    x = logits[index].to(acc) / t.to(acc)[rows]
    return support_log_softmax(x, rows, n).to(out)


def replay_support_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mask: SamplingMask,
    *,
    temperature=1.0,
    bias: Optional[torch.Tensor] = None,
    sparse_grad: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """replay_support_logprobs(hidden @ weight.T + bias, mask) from the LM head's input: only the
    support's weight rows are read (O(nnz x d)), no [N, V] tensor in forward or backward.
    hidden [N, d], weight [V, d], bias [V] or None, one dtype. sparse_grad=True gives the weight a
    sparse COO gradient over the support's rows (as replay_logprobs_from_hidden does)."""
    op = "replay_support_logprobs_from_hidden"
    check_head(op, hidden, weight, bias)
    n, device = hidden.shape[0], hidden.device
    out = output_dtype(out_dtype, hidden.dtype, op)
    acc = compute_dtype(hidden.dtype)
    ids, offsets, rows = mask_csr(mask, n, weight.shape[0], device, op)
    t = temperature_per_row(temperature, n, device, allow_zero=False, op=op,
                            check_values=not torch.compiler.is_compiling()).to(acc)
    x = support_logits(hidden, weight, bias, offsets, rows, ids, sparse_grad=sparse_grad) / t[rows]
    return support_log_softmax(x, rows, n).to(out)


def support_logprobs_padded(
    values: torch.Tensor,
    mask: SamplingMask,
    labels: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    loss_mask: Optional[torch.Tensor] = None,
    width: Optional[int] = None,
    fill: float = float("-inf"),
) -> torch.Tensor:
    """Per-entry values ([nnz], CSR-aligned: replay_support_logprobs or mask.entry_logprobs) as a
    padded tensor, differentiable: [N, W] without labels, or labels.shape + (W,) ([B, T, W], or
    [total, W] packed) with ignored positions filled too. Slot k of a row is its k-th id in
    ascending order (the slots of mask.to_padded()). W is the widest row unless given.

    fill (default -inf, as mask.to_padded pads log-probs: exp(fill) = 0, a padded slot has
    probability 0 in any sum over slots); prime-rl's sampling_mask_logprobs pads with 0 instead:
    pass fill=0.0 for a loss written against that layout, and mask its padding yourself."""
    op = "support_logprobs_padded"
    check_mask_arrays(mask, op)
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"{op}: fill must be a number, got {type(fill).__name__}")
    if isinstance(values, torch.Tensor) and not values.is_floating_point():
        raise ValueError(f"{op}: values must be a floating tensor (log-probs), got {values.dtype}")
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() != mask.nnz:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"{op}: values must be [nnz] = [{mask.nnz}] (one per support entry), got {got}")
    device, n = values.device, mask.num_rows
    _, offsets, rows = mask_csr(mask, n, None, device, op)  # a malformed CSR: one error naming the row
    lengths = offsets[1:] - offsets[:-1]
    widest = int(lengths.max()) if n else 0
    width = widest if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < widest:
        raise ValueError(f"{op}: width must be an integer >= the widest row ({widest}), got {width!r}")
    slots = torch.arange(mask.nnz, device=device) - offsets[rows]
    if labels is None and loss_mask is None:
        out = _padded_output(values, n, width, fill, op)
        return out.index_put((rows, slots), values)
    shape = tuple(labels.shape) if labels is not None else tuple(loss_mask.shape)
    kept = _kept_positions(op, shape, labels, loss_mask, ignore_index, device)
    if kept.numel() != n:
        raise ValueError(f"{op}: the mask has {n} rows but the batch has {kept.numel()} positions that are not "
                         "ignored")
    total = 1
    for s in shape:
        total *= s
    out = _padded_output(values, total, width, fill, op)
    return out.index_put((kept[rows], slots), values).reshape(shape + (width,))


def _padded_output(values: torch.Tensor, rows: int, width: int, fill: float, op: str) -> torch.Tensor:
    """The [rows, width] output, or one error naming width where it cannot be allocated."""
    try:
        return values.new_full((rows, width), fill)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        size = rows * width * values.element_size()
        raise ValueError(f"{op}: width {width} needs a [{rows}, {width}] output ({size / 2 ** 30:.3g} GiB), which "
                         f"cannot be allocated on {values.device} ({str(exc).splitlines()[0][:120]}); pass a "
                         "smaller width (None: the widest row)") from None
