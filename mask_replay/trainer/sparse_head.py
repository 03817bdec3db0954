"""The sparse LM head with a sparse weight gradient: replay from hidden states where the weight's
gradient is a sparse COO tensor over the support's rows, as nn.Embedding(sparse=True) gives.

The support's logits are x_e = <hidden[row_e], weight[id_e]> (+ bias[id_e]), reading only the
support's weight rows; the backward returns the weight gradient as a COO tensor of one [d] value
row per support entry (duplicates summed by whoever consumes it), O(nnz x d), instead of writing
a dense [V, d] tensor. Accumulation: when ``weight.grad``
already holds a dense tensor, autograd's AccumulateGrad adds the sparse gradient into it in place
(``grad += sparse``, no second dense tensor); when it is None, ``weight.grad`` becomes the sparse
tensor itself (optimizers then need sparse support, e.g. SGD or SparseAdam, or densify it).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from mask_replay._ops import FELL_BACK_EMPTY, FELL_BACK_OUTSIDE, REPLAYED, higher_order_error, refuse_double_backward
from mask_replay.csr import check_csr, device_csr, segment_logsumexp, segment_sum
from mask_replay.errors import MaskFormatError
from mask_replay.mask import SamplingMask
from mask_replay.params import compute_dtype, output_dtype, temperature_per_row

# Every int32 id is below this: the bound of the ops that see no logits (losses, padding), where ids
# are only checked to be >= 0.
_NO_VOCAB = 2 ** 31


def check_mask_arrays(mask, op: str) -> None:
    """The mask's CSR arrays as every op takes them (the compiled kernels' contract and words):
    token_ids 1-D int32, offsets 1-D int64 of N + 1 >= 1 entries, both holding data. Checked before
    any value is read, so a malformed mask is one error naming the array, not a torch error from
    deep inside (a 2-D offsets made `torch.stack` fail; float ids were truncated silently)."""
    if not isinstance(mask, SamplingMask):
        raise TypeError(f"{op}: mask must be a SamplingMask, got {type(mask).__name__}")
    ids, offsets = mask.token_ids, mask.offsets
    if ids.dtype != torch.int32 or ids.dim() != 1:
        raise MaskFormatError(f"{op}: token_ids must be a 1-D int32 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise MaskFormatError(f"{op}: offsets must be a 1-D int64 tensor of N + 1 >= 1 entries, got {offsets.dtype} "
                              f"{tuple(offsets.shape)}")
    if torch.compiler.is_compiling():  # traced tensors stand for real ones
        return
    for name, t in (("token_ids", ids), ("offsets", offsets)):
        if t.is_meta:
            raise MaskFormatError(f"{op}: the mask's {name} is a meta tensor (a shape without values)")


def mask_csr(mask: SamplingMask, n: int, vocab: Optional[int], device, op: str):
    """(token_ids int64, offsets int64, row of each entry) of the mask on `device`, checked against n
    rows and a vocabulary of `vocab` (None: an op without logits, ids only >= 0). The values are
    checked in eager mode only (one device read-back): traced by torch.compile, that read-back is
    a data-dependent branch, so the mask is taken as valid there (validate it once beforehand)."""
    check_mask_arrays(mask, op)
    if mask.num_rows != n:
        raise ValueError(f"{op}: the mask has {mask.num_rows} rows but there are {n} rows of logits")
    if torch.compiler.is_compiling():
        ids = mask.token_ids.to(device=device, dtype=torch.int64)
        offsets = mask.offsets.to(device=device, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(n, device=device), offsets[1:] - offsets[:-1],
                                       output_size=ids.numel())
        return ids, offsets, rows
    if torch.device(device).type == "meta":
        raise ValueError(f"{op}: the inputs are meta tensors (shapes without values): the mask is checked against "
                         "their values")
    if vocab is not None:
        return device_csr(mask.token_ids, mask.offsets, n, vocab, device, op)
    try:
        return device_csr(mask.token_ids, mask.offsets, n, _NO_VOCAB, device, op)
    except MaskFormatError:  # named without a vocabulary ("a negative id", not "outside [0, 2^31)")
        check_csr(mask.token_ids.cpu(), mask.offsets.cpu(), source=op)
        raise


def check_head(op: str, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{op}: bias must be a tensor [vocab] or None, got {type(bias).__name__}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be a 2-D tensor [rows, d]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a 2-D tensor [vocab, d]")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{op}: hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight is {weight.dtype} but hidden is {hidden.dtype}; they must match")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{op}: weight has d = {weight.shape[1]} but hidden has d = {hidden.shape[1]}")
    if weight.device != hidden.device:
        raise ValueError(f"{op}: weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != hidden.dtype
                             or bias.device != hidden.device):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}] of hidden's dtype and device, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


def support_logits(hidden, weight, bias, offsets, rows, ids, *, sparse_grad: bool) -> torch.Tensor:
    """x_e = <hidden[rows_e], weight[ids_e]> + bias[ids_e] in the compute dtype ([nnz]), reading
    only the support's weight rows (O(nnz x d)); sparse_grad makes the weight gradient sparse.
    Under torch.compile: one [nnz, d] gather-multiply-sum of torch ops (_SupportDot's CSR kernels
    and chunk loop do not trace), with autograd's dense weight gradient; sparse_grad is refused there."""
    if torch.compiler.is_compiling():
        if sparse_grad:
            raise ValueError("sparse_grad=True (a sparse COO weight gradient) is not supported under torch.compile; "
                             "pass sparse_grad=False there")
        acc = compute_dtype(hidden.dtype)
        x = (hidden.index_select(0, rows).to(acc) * weight.index_select(0, ids).to(acc)).sum(dim=1)
    else:
        x = _SupportDot.apply(hidden, weight, offsets, rows, ids, sparse_grad)
    if bias is not None:
        x = x + bias[ids].to(x.dtype)
    return x


def _fused_csr(t: torch.Tensor) -> bool:
    """torch's CSR kernels (sampled_addmm for the forward, sparse mm for hidden's gradient) do
    each product in one pass, without [nnz, d] temporaries: on the CPU, for float32/float64,
    5-10x faster than gather-multiply-sum. Elsewhere (bf16/fp16 on the CPU, CUDA, whose
    gathers are cheap) the gathers below are used."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _csr(offsets, ids, values, n, vocab):
    with warnings.catch_warnings():  # torch's one-time "CSR support is in beta" notice, not the user's concern
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(offsets, ids, values, (n, vocab), check_invariants=False)


def _chunk(device: torch.device, nnz: int, d: int) -> int:
    """Entries per step of the gathers. On the CPU, [chunk, d] temporaries of 8 MiB or less stay
    in the allocator's heap; whole [nnz, d] ones (32 MiB at nnz = 8192, d = 1024) are fresh mmaps
    whose page faults cost more than the arithmetic. CUDA's caching allocator has no such cost."""
    if device.type != "cpu":
        return max(nnz, 1)
    return max(1, (8 << 20) // (4 * max(d, 1)))


class _SupportDot(torch.autograd.Function):
    """x_e = <hidden[rows_e], weight[ids_e]>, and its gradients: hidden's by a segment sum,
    weight's as the O(nnz x d) values of a sparse COO tensor (or added into a dense one)."""

    @staticmethod
    def forward(ctx, hidden, weight, offsets, rows, ids, sparse_grad):
        acc = compute_dtype(hidden.dtype)
        n, nnz = hidden.shape[0], ids.numel()
        ctx.save_for_backward(hidden, weight, offsets, rows, ids)
        ctx.sparse_grad = sparse_grad
        if nnz and _fused_csr(hidden):
            pattern = _csr(offsets, ids, hidden.new_zeros(nnz), n, weight.shape[0])
            return torch.sparse.sampled_addmm(pattern, hidden, weight.T, beta=0.0).values()
        x = torch.empty(nnz, dtype=acc, device=hidden.device)
        step = _chunk(hidden.device, nnz, hidden.shape[1])
        for lo in range(0, nnz, step):
            r, i = rows[lo:lo + step], ids[lo:lo + step]
            torch.sum(hidden.index_select(0, r).to(acc) * weight.index_select(0, i).to(acc), dim=1, out=x[lo:lo + step])
        return x

    @staticmethod
    def backward(ctx, g):
        hidden, weight, offsets, rows, ids = ctx.saved_tensors
        with torch.no_grad():
            grads = _SupportDot._gradients(ctx, g, hidden, weight, offsets, rows, ids)
        return refuse_double_backward("the sparse LM head (sparse_grad=True, support_*_from_hidden)", grads, hidden,
                                      weight, g)

    @staticmethod
    def _gradients(ctx, g, hidden, weight, offsets, rows, ids):
        acc = g.dtype
        n, nnz, d = hidden.shape[0], ids.numel(), hidden.shape[1]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = values = None
        step = _chunk(hidden.device, nnz, d)
        if want_h and nnz and _fused_csr(hidden):
            grad_h = torch.sparse.mm(_csr(offsets, ids, g.contiguous(), n, weight.shape[0]), weight)
        elif want_h:
            grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
            for lo in range(0, nnz, step):
                r, i, gc = rows[lo:lo + step], ids[lo:lo + step], g[lo:lo + step, None]
                grad_h.index_add_(0, r, gc * weight.index_select(0, i).to(acc))
        if want_w:
            # The gradient's own [nnz, d] values, written in place: one gather, one scaling (the
            # mixed-dtype multiply computes in float32 and rounds once for bf16/fp16).
            values = hidden.index_select(0, rows)
            values.mul_(g[:, None])
        grad_w = None
        if values is not None:
            if ctx.sparse_grad:
                grad_w = torch.sparse_coo_tensor(ids[None], values, weight.shape, check_invariants=False)
            else:
                grad_w = torch.zeros_like(weight).index_add_(0, ids, values)
        return (grad_h.to(hidden.dtype) if grad_h is not None else None), grad_w, None, None, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise higher_order_error("the sparse LM head (sparse_grad=True, support_*_from_hidden)", "forward-mode AD")


class _FullProjection(torch.autograd.Function):
    """hidden_f @ weight.T + bias for the few fallback rows; with sparse_grad the weight gradient
    (dense over the vocabulary by nature: a full softmax touches every row) is still returned as a
    sparse COO tensor, so that weight.grad keeps one layout."""

    @staticmethod
    def forward(ctx, hidden_f, weight, bias, sparse_grad):
        ctx.save_for_backward(hidden_f, weight)
        ctx.sparse_grad, ctx.has_bias = sparse_grad, bias is not None
        z = hidden_f @ weight.T
        return z + bias if bias is not None else z

    @staticmethod
    def backward(ctx, g):
        hidden_f, weight = ctx.saved_tensors
        gh = g @ weight
        gw = g.T @ hidden_f
        if ctx.sparse_grad:
            idx = torch.arange(weight.shape[0], device=weight.device)[None]
            gw = torch.sparse_coo_tensor(idx, gw, weight.shape, is_coalesced=True, check_invariants=False)
        return gh, gw, (g.sum(0) if ctx.has_bias else None), None

    @staticmethod
    def jvp(ctx, *tangents):
        raise higher_order_error("the sparse LM head's fallback rows (sparse_grad=True)", "forward-mode AD")


def replay_from_hidden_sparse(hidden, weight, mask, sampled, temperature=1.0, bias=None, *, fallback=False,
                              return_status=False, out_dtype=None):
    """replay_logprobs_from_hidden with a sparse weight gradient (see the module docstring)."""
    op = "replay_logprobs_from_hidden"
    check_head(op, hidden, weight, bias)
    n, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    out = output_dtype(out_dtype, hidden.dtype, op)
    ids, offsets, rows = mask_csr(mask, n, vocab, device, op)
    t = temperature_per_row(temperature, n, device, allow_zero=False, op=op, check_values=True)
    if sampled is None:
        if mask.sampled is None:
            raise ValueError(f"{op}: sampled is required (the mask carries no sampled tokens)")
        sampled = mask.sampled
    if (not isinstance(sampled, torch.Tensor) or sampled.shape != (n,) or sampled.is_floating_point()
            or sampled.dtype == torch.bool):
        raise ValueError(f"{op}: sampled must be an integer tensor of shape [{n}]")
    y = sampled.to(device=device, dtype=torch.int64)
    bad = (y < 0) | (y >= vocab)
    if bool(bad.any()):
        r = int(torch.nonzero(bad)[0])
        raise ValueError(f"{op}: sampled token {int(y[r])} of row {r} is out of range [0, {vocab})")

    is_y = ids == y[rows]
    lengths = offsets[1:] - offsets[:-1]
    found = segment_sum(is_y.to(torch.int64), rows, n) > 0
    status = torch.where(lengths == 0, FELL_BACK_EMPTY, torch.where(found, REPLAYED, FELL_BACK_OUTSIDE))
    status = status.to(torch.int8)
    if not fallback and bool((status != REPLAYED).any()):
        r = int(torch.nonzero(status != REPLAYED)[0])
        if int(status[r]) == FELL_BACK_EMPTY:
            raise ValueError(f"{op}: row {r} has an empty support; pass fallback=True to use the full vocabulary")
        raise ValueError(f"{op}: sampled token {int(y[r])} is outside the support of row {r} "
                         f"({int(lengths[r])} tokens); pass fallback=True to use the full vocabulary for such rows")

    acc = compute_dtype(hidden.dtype)
    x = support_logits(hidden, weight, bias, offsets, rows, ids, sparse_grad=True) / t[rows].to(acc)
    lse = segment_logsumexp(x, rows, n)
    x_y = segment_sum(torch.where(is_y, x, torch.zeros_like(x)), rows, n)
    replayed = status == REPLAYED
    # Rows that fall back have lse = -inf (empty) or x_y = 0 (outside): masked before subtracting.
    logp = torch.where(replayed, x_y - torch.where(replayed, lse, torch.zeros_like(lse)), torch.zeros_like(lse))
    fb = torch.nonzero(~replayed)[:, 0]
    if fb.numel():
        z = _FullProjection.apply(hidden.index_select(0, fb), weight, bias, True)
        xf = z.to(x.dtype) / t[fb, None].to(x.dtype)
        lp_f = torch.log_softmax(xf, dim=1).gather(1, y[fb, None])[:, 0]
        logp = logp.index_put((fb,), lp_f)
    logp = logp.to(out)
    return (logp, status) if return_status else logp
