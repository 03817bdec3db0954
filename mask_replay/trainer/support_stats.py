"""Entropy and KL over the recorded support, O(nnz), with gradients (CPU and CUDA alike).

With q = softmax(x / T) renormalised over each row's support K:
    support_entropy = -sum_{j in K} q_j log q_j
    support_kl      =  sum_{j in K} p_j (log p_j - log r_j)   (policy p vs reference r, both over K)

Conventions: a -inf logit inside K has probability 0 and adds 0 (0 log 0 = 0); a row whose
support is empty or holds only -inf logits has no distribution and gives 0 (gradient 0); a token
with p_j > 0 but r_j = 0 makes the KL +inf. NaN or +inf logits give NaN. Results are float32
(float64 for float64 input), accumulated in float32 whatever the input; ``out_dtype`` as in
replay_logprobs. Logits may be [N, V], or [B, T, V] with a ``loss_mask`` [B, T] naming the
positions the mask's rows belong to (row-major; the result is then [B, T], 0 elsewhere).
temperature: a scalar or one value per mask row.
The *_from_hidden variants take the LM head's input and weight and never form [N, V] logits.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay.csr import log_probs_over_support, segment_sum
from mask_replay.params import compute_dtype, output_dtype, temperature_per_row
from mask_replay.trainer.sparse_head import check_head, mask_csr, support_logits


def _check_logits(op: str, logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        raise ValueError(f"{op}: {name} must be a tensor [N, V] or [B, T, V]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{op}: {name} must be float32, bfloat16, float16 or float64, got {logits.dtype}")


def _positions(op: str, logits: torch.Tensor, loss_mask: Optional[torch.Tensor]):
    """(index of the positions the mask rows belong to, as a tuple for advanced indexing; their
    count; the output shape and flat kept positions, or None for [N, V] logits)."""
    if logits.dim() == 2:
        if loss_mask is not None:
            raise ValueError(f"{op}: loss_mask is for [B, T, V] logits")
        n = logits.shape[0]
        return (torch.arange(n, device=logits.device),), n, None
    if loss_mask is None:
        raise ValueError(f"{op}: [B, T, V] logits need loss_mask [B, T] to place the mask's rows")
    shape = tuple(logits.shape[:2])
    if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != shape:
        raise ValueError(f"{op}: loss_mask must have shape {list(shape)}")
    b, t = torch.nonzero(loss_mask.to(logits.device) != 0, as_tuple=True)
    return (b, t), b.numel(), (shape, b * shape[1] + t)


def _gather(logits, where, rows, ids, t_rows):
    """The support's logits divided by T, in the compute dtype ([nnz]); autograd scatters the
    gradient back into the logits' own shape."""
    picked = logits[tuple(w[rows] for w in where) + (ids,)]
    return picked.to(compute_dtype(logits.dtype)) / t_rows


def _place(values, placement, dtype):
    """[N] per mask row -> the caller's shape ([N], or [B, T] with zeros off the loss mask)."""
    if placement is None:
        return values.to(dtype)
    shape, flat = placement
    out = torch.zeros(shape[0] * shape[1], dtype=values.dtype, device=values.device).index_put((flat,), values)
    return out.reshape(shape).to(dtype)


def _entropy(x, rows, n):
    logq, q, _, _ = log_probs_over_support(x, rows, n)
    return -segment_sum(q * logq, rows, n)  # dead rows and -inf entries have q = 0 and log q = 0


def _kl(xp, xr, rows, n):
    logp, p, _, _ = log_probs_over_support(xp, rows, n)
    logr, _, r_positive, _ = log_probs_over_support(xr, rows, n)
    kl = segment_sum(p * (logp - logr), rows, n)
    # p_j > 0 where r_j = 0: the KL is infinite (log r_j stood in as 0 above).
    infinite = segment_sum(((p > 0) & ~r_positive).to(torch.int64), rows, n) > 0
    return torch.where(infinite, torch.full_like(kl, float("inf")), kl)


def support_entropy(logits: torch.Tensor, mask, temperature=1.0, *, loss_mask=None,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Entropy of softmax(logits / T) renormalised over each row's support (see the module)."""
    op = "support_entropy"
    _check_logits(op, logits)
    where, n, placement = _positions(op, logits, loss_mask)
    ids, _, rows = mask_csr(mask, n, logits.shape[-1], logits.device, op)
    t = temperature_per_row(temperature, n, logits.device, allow_zero=False, op=op, check_values=True)
    t = t.to(compute_dtype(logits.dtype))
    x = _gather(logits, where, rows, ids, t[rows])
    return _place(_entropy(x, rows, n), placement, output_dtype(out_dtype, logits.dtype, op))


def support_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, mask, temperature=1.0, *, loss_mask=None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """KL(p_K || q_K): policy logits_p against reference logits_q, both renormalised over each
    row's support, at the same temperature (see the module). Differentiable w.r.t. both."""
    op = "support_kl"
    _check_logits(op, logits_p, "logits_p")
    _check_logits(op, logits_q, "logits_q")
    if logits_p.shape != logits_q.shape or logits_p.device != logits_q.device:
        raise ValueError(f"{op}: logits_p {tuple(logits_p.shape)} on {logits_p.device} and logits_q "
                         f"{tuple(logits_q.shape)} on {logits_q.device} must have one shape and device")
    where, n, placement = _positions(op, logits_p, loss_mask)
    ids, _, rows = mask_csr(mask, n, logits_p.shape[-1], logits_p.device, op)
    t = temperature_per_row(temperature, n, logits_p.device, allow_zero=False, op=op, check_values=True)
    t = t.to(compute_dtype(logits_p.dtype))
    xp = _gather(logits_p, where, rows, ids, t[rows])
    xq = _gather(logits_q, where, rows, ids, t[rows]).to(xp.dtype)
    return _place(_kl(xp, xq, rows, n), placement, output_dtype(out_dtype, logits_p.dtype, op))


def _head_logits(op, hidden, weight, bias, mask, temperature, sparse_grad, name=""):
    check_head(op + name, hidden, weight, bias)
    n = hidden.shape[0]
    ids, offsets, rows = mask_csr(mask, n, weight.shape[0], hidden.device, op)
    t = temperature_per_row(temperature, n, hidden.device, allow_zero=False, op=op, check_values=True)
    t = t.to(compute_dtype(hidden.dtype))
    return support_logits(hidden, weight, bias, offsets, rows, ids, sparse_grad=sparse_grad) / t[rows], rows, n


def support_entropy_from_hidden(hidden, weight, mask, temperature=1.0, bias=None, *, sparse_grad: bool = False,
                                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """support_entropy(hidden @ weight.T + bias, ...) reading only the support's weight rows,
    O(nnz x d); sparse_grad makes the weight gradient a sparse COO tensor (see sparse_head)."""
    x, rows, n = _head_logits("support_entropy_from_hidden", hidden, weight, bias, mask, temperature, sparse_grad)
    return _entropy(x, rows, n).to(output_dtype(out_dtype, hidden.dtype, "support_entropy_from_hidden"))


def support_kl_from_hidden(hidden_p, weight_p, hidden_q, weight_q, mask, temperature=1.0, bias_p=None, bias_q=None,
                           *, sparse_grad: bool = False, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """support_kl of the policy head (hidden_p, weight_p, bias_p) against the reference head
    (hidden_q, weight_q, bias_q), O(nnz x d), never forming [N, V] logits."""
    op = "support_kl_from_hidden"
    check_head(op + " (policy)", hidden_p, weight_p, bias_p)  # first: the comparisons below read their shapes
    check_head(op + " (reference)", hidden_q, weight_q, bias_q)
    if hidden_p.shape[0] != hidden_q.shape[0]:
        raise ValueError(f"{op}: hidden_p has {hidden_p.shape[0]} rows but hidden_q has {hidden_q.shape[0]}")
    if weight_p.shape[0] != weight_q.shape[0]:
        raise ValueError(f"{op}: weight_p has {weight_p.shape[0]} rows (vocab) but weight_q has {weight_q.shape[0]}")
    xp, rows, n = _head_logits(op, hidden_p, weight_p, bias_p, mask, temperature, sparse_grad, " (policy)")
    xq, _, _ = _head_logits(op, hidden_q, weight_q, bias_q, mask, temperature, sparse_grad, " (reference)")
    return _kl(xp, xq.to(xp.dtype), rows, n).to(output_dtype(out_dtype, hidden_p.dtype, op))
