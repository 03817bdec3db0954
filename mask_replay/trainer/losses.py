"""Losses over the replayed support. score_centered_pg: the importance-weighted policy gradient minus its
expectation under the rollout distribution, exact over the recorded support (docs/score_centering.md).

Per token with support S, sampled y, advantage A, trainer log-probs lp and rollout log-probs lq over S
(both normalised over S: replay_support_logprobs and mask.entry_logprobs), cap C, w(r) = min(r, C),
sg = stop-gradient:

    loss = -A * ( sg(w(p_y / q_y)) * lp_y  -  sum_{v in S} sg(q_v * w(p_v / q_v)) * lp_v )

    d loss / d theta = -A * ( w_y grad lp_y - E_{v ~ q}[ w_v grad lp_v ] )

The second term is the expectation of the first under y ~ q, the distribution the rollout sampled
from, which lives exactly on S: its expectation over y is zero for any p, q and C, and at p = q it
vanishes itself (sum_v q_v grad log p_v = grad sum_v p_v = 0). O(nnz), torch ops only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from mask_replay.csr import segment_sum
from mask_replay.errors import InputError, OutsideSupportError
from mask_replay.mask import SamplingMask
from mask_replay.params import INT_DTYPES, ignore_index_value
from mask_replay.trainer.sparse_head import check_mask_arrays, mask_csr

__all__ = ["score_centered_pg", "DEFAULT_CAP"]

DEFAULT_CAP = 2.0
COEFFICIENT_L1 = "score_centering/coefficient_l1"
RATIO_TRUNCATED = "ratio_truncated_frac"
INF = float("inf")


def _refuse_bad_rows(op, bad_row, bad_entry, found, has_support, lp, lq, ids, sampled, offsets) -> None:
    """One error naming the first bad row: a sampled token outside its (non-empty) support, or a NaN /
    +inf log-prob (treating it as probability 0 would change the loss without a word)."""
    if not bool(bad_row.any()):
        return
    r = int(torch.nonzero(bad_row)[0])
    start, stop = int(offsets[r]), int(offsets[r + 1])
    if bool(has_support[r]) and int(found[r]) != 1:
        raise OutsideSupportError(f"{op}: sampled token {int(sampled[r])} is not in the support of row {r} "
                                  f"({stop - start} tokens): no ratio p_y / q_y there")
    e = start + int(torch.nonzero(bad_entry[start:stop])[0])
    for name, t in (("trainer_logprobs", lp), ("rollout_logprobs", lq)):
        if not bool(torch.isfinite(t[e]) | (t[e] == -INF)):
            raise InputError(f"{op}: {name} has {float(t[e])} at row {r} (token {int(ids[e])}, entry {e}); "
                             "a log-prob must be a number <= 0 or -inf (probability 0)")


def _row_values(name: str, values, n: int, shape, kept, device, dtype) -> torch.Tensor:
    """A scalar, [N] per mask row, or the labels' shape (read at the kept positions) -> [N]."""
    if not isinstance(values, torch.Tensor):
        if isinstance(values, bool) or not isinstance(values, (int, float)):
            raise TypeError(f"score_centered_pg: {name} must be a number or a tensor, got {type(values).__name__}")
        return torch.full((n,), float(values), dtype=dtype, device=device)
    if not (values.is_floating_point() or values.dtype in INT_DTYPES):
        raise ValueError(f"score_centered_pg: {name} must hold numbers, got {values.dtype}")
    if values.is_meta:
        raise ValueError(f"score_centered_pg: {name} is a meta tensor (a shape without values)")
    v = values.to(device=device, dtype=dtype)
    if v.dim() == 0:
        return v.expand(n)
    if tuple(v.shape) == (n,):
        return v
    if shape is not None and tuple(v.shape) == tuple(shape):
        return v.reshape(-1)[kept]
    want = f"[{n}] (one per mask row)" + (f" or {list(shape)} (the labels' shape)" if shape is not None else "")
    raise ValueError(f"score_centered_pg: {name} must be a scalar or {want}, got {tuple(v.shape)}")


def score_centered_pg(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: SamplingMask,
    advantages,
    *,
    sampled: Optional[torch.Tensor] = None,
    cap: float = DEFAULT_CAP,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    loss_mask: Optional[torch.Tensor] = None,
):
    """The score-centered policy-gradient loss per token, and its metrics.

    trainer_logprobs [nnz]: replay_support_logprobs of the trainer's logits (differentiable);
    rollout_logprobs [nnz]: the rollout's (mask.entry_logprobs), no gradient; both CSR-aligned with
    mask.token_ids. advantages: a scalar, [N] per mask row, or the labels' shape. sampled [N]
    (default mask.sampled) must lie in its row's support. cap: C > 0 (w(r) = min(r, C)).

    Returns (loss, metrics). loss is [N] (per mask row), or with labels / loss_mask the labels'
    shape with 0 at ignored positions (gradient 0 there), like replay_logprobs' batch layouts.
    metrics (0-d detached tensors, means over the tokens with a non-empty support):
    "score_centering/coefficient_l1", the sum over S of |q_v w_v| per token; "ratio_truncated_frac",
    the share of tokens whose p_y / q_y > C (q_y = 0 < p_y counts, with w_y = C). Reduce the loss as
    your trainer does (mean over tokens, per sequence, ...).

    A row with an empty support (a forced token: replay_logprobs(fallback=True) reports it as
    FELL_BACK_EMPTY) has loss 0 and no gradient: the rollout put all its mass on y, there is no
    distribution over S to weight or centre, as with |S| = 1. Its ``sampled`` entry is not checked.
    A NaN or +inf log-prob (either side, any entry) raises an InputError naming the row and token;
    under torch.compile that check is not run and the row's loss is NaN instead, nor is the check that
    the labels / loss_mask keep exactly one position per mask row (it traces with fullgraph=True).
    """
    op = "score_centered_pg"
    check_mask_arrays(mask, op)
    n, nnz = mask.num_rows, mask.nnz
    for name, t in (("trainer_logprobs", trainer_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != nnz or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a floating tensor [nnz] = [{nnz}] aligned with the mask's "
                             f"token_ids, got {got}")
        if t.is_meta:
            raise ValueError(f"{op}: {name} is a meta tensor (a shape without values)")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"{op}: cap must be a number > 0, got {cap!r}")
    lp = trainer_logprobs
    device, dtype = lp.device, lp.dtype
    lq = rollout_logprobs.detach().to(device=device, dtype=dtype)

    shape = kept = None
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if labels is not None and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        raise ValueError(f"{op}: labels must hold integer token ids, got {labels.dtype}")
    if labels is not None or loss_mask is not None:
        shape = tuple(labels.shape) if labels is not None else tuple(loss_mask.shape)
        keep = torch.ones(shape, dtype=torch.bool, device=device)
        if labels is not None:
            keep &= labels.to(device) != ignore_index_value(ignore_index, op)
        if loss_mask is not None:
            if tuple(loss_mask.shape) != shape:
                raise ValueError(f"{op}: loss_mask must have the labels' shape {list(shape)}, got "
                                 f"{tuple(loss_mask.shape)}")
            keep &= loss_mask.to(device) != 0
        keep = keep.reshape(-1)
        if not torch.compiler.is_compiling():  # host-side check; traced, a miscount is the caller's to avoid
            count = int(keep.sum())
            if count != n:
                raise ValueError(f"{op}: the mask has {n} rows but the batch has {count} positions that are not "
                                 "ignored")
        # a static size (the rows the mask says there are) keeps torch.compile(fullgraph=True) tracing
        kept = torch.nonzero_static(keep, size=n)[:, 0]
    adv = _row_values("advantages", advantages, n, shape, kept, device, dtype)

    if sampled is None:
        if mask.sampled is None:
            raise ValueError(f"{op}: sampled is required (the mask carries no sampled tokens)")
        sampled = mask.sampled
    if not isinstance(sampled, torch.Tensor) or tuple(sampled.shape) != (n,):
        raise ValueError(f"{op}: sampled must be a tensor [{n}] (one per mask row)")
    if sampled.dtype not in INT_DTYPES:
        raise ValueError(f"{op}: sampled must hold integer token ids, got {sampled.dtype}")
    ids, offsets, rows = mask_csr(mask, n, None, device, op)  # a malformed CSR: one error naming the row
    lengths = offsets[1:] - offsets[:-1]
    is_y = ids == sampled.to(device=device, dtype=torch.int64)[rows]
    found = segment_sum(is_y.to(torch.int64), rows, n)
    has_support = lengths > 0  # an empty row is a forced token: loss 0, outside the metrics (module doc)
    bad_entry = torch.isnan(lp.detach()) | torch.isnan(lq) | (lp.detach() == INF) | (lq == INF)
    bad_row = (has_support & (found != 1)) | (segment_sum(bad_entry.to(torch.int64), rows, n) > 0)
    if not torch.compiler.is_compiling():  # host-side checks; traced, a bad row's loss is NaN instead
        _refuse_bad_rows(op, bad_row, bad_entry, found, has_support, lp, lq, ids, sampled, offsets)

    w_y, coef, truncated = centering_weights(lp.detach(), lq, rows, is_y, n, cap)
    loss = -adv * surrogate(lp, w_y, coef, rows, is_y, n)
    loss = torch.where(bad_row, torch.full_like(loss, float("nan")), loss)
    kept_rows = has_support.to(dtype)
    count = kept_rows.sum().clamp(min=1)
    metrics = {
        COEFFICIENT_L1: (segment_sum(coef.abs(), rows, n) * kept_rows).sum() / count,
        RATIO_TRUNCATED: (truncated * kept_rows).sum() / count,
    }
    if shape is not None:
        total = 1
        for s in shape:
            total *= s
        loss = torch.zeros(total, dtype=loss.dtype, device=device).index_put((kept,), loss).reshape(shape)
    return loss, metrics


@torch.no_grad()
def centering_weights(lp: torch.Tensor, lq: torch.Tensor, rows, is_y, n: int, cap: float):
    """The stop-gradient factors: (w_y [N], q_v w_v [nnz], 1 where p_y / q_y > cap [N]). The ratio
    is taken in log space; q_v = 0 (lq = -inf) gives a 0 coefficient, not 0 * inf, and p_y / q_y =
    +inf for a sampled entry with q_y = 0 < p_y: w_y = C, counted as truncated."""
    # q_v = 0 (lq = -inf): the ratio is +inf where p_v > 0 (weight C, truncated) and 0 where p_v = 0
    # too; the weight and the truncation count read the same log-ratio, so they always agree.
    q_zero = lq == -INF
    log_ratio = torch.where(q_zero, torch.where(lp > -INF, INF, -INF), lp - lq)
    w = torch.clamp(torch.exp(log_ratio), max=cap)
    q = torch.exp(lq)
    coef = torch.where(q > 0, q * w, torch.zeros_like(q))
    w_y = segment_sum(torch.where(is_y, w, torch.zeros_like(w)), rows, n)
    over = is_y & (log_ratio > math.log(cap))
    return w_y, coef, segment_sum(over.to(lp.dtype), rows, n)


def surrogate(lp: torch.Tensor, w_y, coef, rows, is_y, n: int) -> torch.Tensor:
    """w_y lp_y - sum_v coef_v lp_v per row ([N]), differentiable w.r.t. lp only. Entries with
    lp = -inf (trainer probability 0) carry no gradient and are kept out of the sums."""
    finite = torch.isfinite(lp)
    lp0 = torch.where(finite, lp, torch.zeros_like(lp))
    lp_y = segment_sum(torch.where(is_y, lp0, torch.zeros_like(lp0)), rows, n)
    centre = segment_sum(torch.where(finite, coef, torch.zeros_like(coef)) * lp0, rows, n)
    return w_y * lp_y - centre
