"""Replay with a vocabulary sharded over the ranks of a tensor-parallel group (Megatron layout).

Rank p holds the logits (or the LM-head weight rows) of tokens [vocab_start, vocab_start + V_p).
Each rank reduces over the support ids inside its shard, O(nnz) gathers and segment reductions:
    per row:  local logsumexp of x_j = z_j / T over K  intersected with its shard,
              x_y if it owns the sampled token (else 0), plus exact integer counts
              (support entries it holds, whether y is among them, whether it owns y)

then ONE all_gather of these [N, 5] values. Every rank combines the gathered rows in rank order,
so all ranks hold bit-identical log-probs, and the counts check the layout for free: each support
id and each sampled token must fall in exactly one shard.

Autograd follows the tensor-parallel contract of collectives.py: every rank backpropagates the
same replicated loss and receives the gradient of its own shard. Fallback rows (sampled token
outside K, or K empty) need the full-vocabulary logsumexp of their row: a second all_gather, over
those rows only, entered by every rank because all of them know the same fallback rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mask_replay._ops import FELL_BACK_EMPTY, FELL_BACK_OUTSIDE, REPLAYED
from mask_replay.csr import minus_row_lse, segment_logsumexp
from mask_replay.mask import SamplingMask
from mask_replay.params import FLOAT_DTYPES, temperature_per_row
from mask_replay.trainer.collectives import copy_to_group, gather_rows
from mask_replay.trainer.replay import Temperature, _sampled
from mask_replay.trainer.sparse_head import check_mask_arrays, mask_csr


def replay_logprobs_vocab_parallel(
    logits_shard: torch.Tensor,
    mask: SamplingMask,
    sampled: Optional[torch.Tensor] = None,
    *,
    vocab_start: int,
    group=None,
    temperature: Temperature = 1.0,
    fallback: bool = False,
    return_status: bool = False,
):
    """mask_replay.replay_logprobs over a vocabulary split across the ranks of ``group``.

    logits_shard [N, V_p]: this rank's columns [vocab_start, vocab_start + V_p) of the logits
    (shards may be uneven; together they must tile [0, V) without overlap). mask, sampled and
    temperature are the global ones, identical on every rank. Returns the log-probs [N] (float32,
    float64 for float64 logits), identical on every rank, differentiable w.r.t. logits_shard;
    with ``return_status`` also the int8 status of mask_replay.replay_logprobs.
    """
    _check_matrix(logits_shard, "logits_shard")
    n, vp = logits_shard.shape
    acc = torch.float64 if logits_shard.dtype == torch.float64 else torch.float32

    def entries(rows, cols):
        return logits_shard[rows, cols].to(acc)

    def dense(rows):
        return logits_shard[rows].to(acc)

    return _replay("replay_logprobs_vocab_parallel", n, vp, logits_shard.device, acc, entries, dense, mask, sampled,
                   vocab_start, group, temperature, fallback, return_status)


def replay_logprobs_vocab_parallel_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    mask: SamplingMask,
    sampled: Optional[torch.Tensor] = None,
    *,
    vocab_start: int,
    group=None,
    temperature: Temperature = 1.0,
    bias_shard: Optional[torch.Tensor] = None,
    fallback: bool = False,
    return_status: bool = False,
    reduce_hidden_grad: bool = True,
):
    """The sparse LM head, vocab-parallel: logits only for the support ids of this rank's shard.

    hidden [N, d] (replicated), weight_shard [V_p, d] and bias_shard [V_p] or None: this rank's
    rows [vocab_start, vocab_start + V_p) of the LM head. With ``reduce_hidden_grad`` (default) the
    backward all-reduces the gradient of ``hidden`` over the group, as Megatron's column-parallel
    LM head does, so every rank receives the full gradient; pass False when the caller already
    wraps hidden in its own copy-to-tensor-parallel-region. Logits are formed in float32 (float64
    for float64 inputs); in bfloat16/float16 each support entry's weight gradient is rounded to the
    weight's dtype before torch's indexing backward sums the entries of a token shared by several
    rows (the single-process kernel sums in float32 first).
    """
    _check_matrix(hidden, "hidden")
    _check_matrix(weight_shard, "weight_shard")
    if weight_shard.dtype != hidden.dtype or weight_shard.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight_shard: expected [V_p, {hidden.shape[1]}] {hidden.dtype} like hidden, "
                         f"got {list(weight_shard.shape)} {weight_shard.dtype}")
    for name, t in (("weight_shard", weight_shard), ("bias_shard", bias_shard)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if bias_shard is not None and (bias_shard.dim() != 1 or bias_shard.shape[0] != weight_shard.shape[0]
                                   or bias_shard.dtype != hidden.dtype):
        raise ValueError(f"bias_shard: expected [{weight_shard.shape[0]}] {hidden.dtype}, "
                         f"got {list(bias_shard.shape)} {bias_shard.dtype}")
    n, vp = hidden.shape[0], weight_shard.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    h = copy_to_group(hidden, group) if reduce_hidden_grad else hidden

    def entries(rows, cols):
        z = (h[rows].to(acc) * weight_shard[cols].to(acc)).sum(-1)
        return z + bias_shard[cols].to(acc) if bias_shard is not None else z

    def dense(rows):
        z = h[rows].to(acc) @ weight_shard.to(acc).T
        return z + bias_shard.to(acc) if bias_shard is not None else z

    return _replay("replay_logprobs_vocab_parallel_from_hidden", n, vp, hidden.device, acc, entries, dense, mask,
                   sampled, vocab_start, group, temperature, fallback, return_status)


def _check_matrix(t, name):
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        what = f"{t.dim()}-D" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor, got {what}")
    if t.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")


def _replay(op: str, n: int, vp: int, device, acc, entries: Callable, dense: Callable, mask, sampled, vocab_start,
            group, temperature, fallback, return_status):
    check_mask_arrays(mask, op)  # before its row count is read
    if mask.num_rows != n:
        raise ValueError(f"mask has {mask.num_rows} rows but the shard has {n}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    # the whole CSR contract but the vocabulary (each rank holds a shard of it; _check_layout checks that)
    ids, offsets, rows = mask_csr(mask, n, None, device, op)
    lengths = offsets[1:] - offsets[:-1]
    y = _sampled(sampled, mask, n, device)
    t = temperature_per_row(temperature, n, device, allow_zero=False)
    bad_t = torch.nonzero(~(torch.isfinite(t) & (t > 0))).flatten()
    if bad_t.numel():
        r = int(bad_t[0])
        raise ValueError(f"temperature must be finite and > 0, row {r} has {float(t[r])}")
    temp = t.to(acc)

    # ---- this rank's share: support ids inside [vocab_start, vocab_start + vp) ----------------
    mine = (ids >= vocab_start) & (ids < vocab_start + vp)
    lrows, lcols = rows[mine], ids[mine] - vocab_start
    x = entries(lrows, lcols) / temp[lrows]
    # Reductions in double; the max is a constant of the formula (detached: exact gradient).
    x64 = x.double()
    lse_local = segment_logsumexp(x64, lrows, n)  # -inf where this rank holds none of the row's support
    # x_y is taken from the same gathered entry as the logsumexp's, so in reduced precision the two
    # gradient terms meet in float32 and are rounded to the logits' dtype once (as in the kernels)
    hit = lcols + vocab_start == y[lrows]
    xy = torch.zeros(n, dtype=torch.float64, device=device).index_add(
        0, lrows, torch.where(hit, x64, torch.zeros_like(x64)))
    owned = (y >= vocab_start) & (y < vocab_start + vp)
    counts = torch.stack([
        torch.zeros(n, dtype=torch.float64, device=device).index_add(0, lrows, hit.double()),
        torch.bincount(lrows, minlength=n).double(),
        owned.double(),
    ], 1)

    # ---- one collective, combined identically on every rank (rank order) -----------------------
    g = gather_rows(torch.cat([lse_local[:, None], xy[:, None], counts], 1), group)  # [P, N, 5]
    in_k, held, owners = (g[:, :, c].detach().sum(0) for c in (2, 3, 4))
    _check_layout(held, lengths, owners, y, vocab_start, vp)
    empty = lengths == 0
    lse_parts = torch.where(empty[None, :], torch.zeros_like(g[:, :, 0]), g[:, :, 0])
    lse = torch.where(empty, float("-inf"), torch.logsumexp(lse_parts, 0))
    xy_all = g[:, :, 1].sum(0)  # one owner per row (when y is in K): the others add exact zeros

    status = torch.full((n,), REPLAYED, dtype=torch.int8, device=device)
    status[(in_k == 0) & ~empty] = FELL_BACK_OUTSIDE
    status[empty] = FELL_BACK_EMPTY
    logp = torch.where(status == REPLAYED, xy_all - torch.where(empty, 0.0, lse), torch.zeros_like(xy_all))
    back = torch.nonzero(status != REPLAYED).flatten()
    if back.numel():
        if not fallback:
            _raise_row_error(int(back[0]), status, y, lengths)
        # the full rows: their logsumexp, and x_y from the owner (y may be outside K here)
        xb = (dense(back) / temp[back, None]).double()
        yb = y[back] - vocab_start
        mine_b = owned[back]
        xy_b = torch.where(mine_b, xb.gather(1, yb.clamp(0, vp - 1)[:, None])[:, 0], torch.zeros_like(xb[:, 0]))
        gb = gather_rows(torch.stack([torch.logsumexp(xb, 1), xy_b], 1), group)  # [P, F, 2]
        logp = logp.index_copy(0, back, gb[:, :, 1].sum(0) - torch.logsumexp(gb[:, :, 0], 0))
    out = logp.to(acc)
    return (out, status) if return_status else out


def _check_layout(held, lengths, owners, y, vocab_start, vp):
    """Every support id and every sampled token must lie in exactly one rank's shard."""
    bad = torch.nonzero(held != lengths.double()).flatten()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"mask: row {r} holds token ids outside the ranks' shards, or shards overlap "
                         f"({int(held[r])} of {int(lengths[r])} ids found; this rank holds "
                         f"[{vocab_start}, {vocab_start + vp}))")
    bad = torch.nonzero(owners != 1).flatten()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"sampled token {int(y[r])} of row {r} lies in {int(owners[r])} ranks' shards "
                         f"(expected exactly one; this rank holds [{vocab_start}, {vocab_start + vp}))")


def _raise_row_error(r, status, y, lengths):
    if int(status[r]) == FELL_BACK_EMPTY:
        raise ValueError(f"replay_vocab_parallel: row {r} has an empty support; pass fallback=True to use "
                         "the full vocabulary")
    raise ValueError(f"replay_vocab_parallel: sampled token {int(y[r])} is outside the support of row {r} "
                     f"({int(lengths[r])} tokens); pass fallback=True to use the full vocabulary for such rows")


# ---- the whole support's log-probs ------------------------------------------------------------------
def replay_support_logprobs_vocab_parallel(
    logits_shard: torch.Tensor,
    mask: SamplingMask,
    *,
    vocab_start: int,
    group=None,
    temperature: Temperature = 1.0,
) -> torch.Tensor:
    """mask_replay.replay_support_logprobs over a vocabulary split across the ranks of ``group``:
    the log-prob of every support entry, [nnz] aligned with mask.token_ids, identical on every rank,
    differentiable w.r.t. this rank's shard. One all_gather of [N + nnz, 2] values: each rank's
    per-row logsumexp over its share of the support, and its entries' x = z / T (0 for entries of
    other shards), with exact counts that check every id lies in exactly one shard."""
    _check_matrix(logits_shard, "logits_shard")
    n, vp = logits_shard.shape
    acc = torch.float64 if logits_shard.dtype == torch.float64 else torch.float32
    return _support("replay_support_logprobs_vocab_parallel", n, vp, logits_shard.device, acc,
                    lambda rows, cols: logits_shard[rows, cols].to(acc), mask, vocab_start, group, temperature)


def replay_support_logprobs_vocab_parallel_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    mask: SamplingMask,
    *,
    vocab_start: int,
    group=None,
    temperature: Temperature = 1.0,
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """The same from the LM head's input and this rank's weight rows (logits only for the support ids
    of the shard); reduce_hidden_grad as in replay_logprobs_vocab_parallel_from_hidden."""
    _check_matrix(hidden, "hidden")
    _check_matrix(weight_shard, "weight_shard")
    if weight_shard.dtype != hidden.dtype or weight_shard.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight_shard: expected [V_p, {hidden.shape[1]}] {hidden.dtype} like hidden, "
                         f"got {list(weight_shard.shape)} {weight_shard.dtype}")
    n, vp = hidden.shape[0], weight_shard.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    h = copy_to_group(hidden, group) if reduce_hidden_grad else hidden

    def entries(rows, cols):
        return (h[rows].to(acc) * weight_shard[cols].to(acc)).sum(-1)

    return _support("replay_support_logprobs_vocab_parallel_from_hidden", n, vp, hidden.device, acc, entries, mask,
                    vocab_start, group, temperature)


def _support(op: str, n, vp, device, acc, entries: Callable, mask, vocab_start, group, temperature):
    check_mask_arrays(mask, op)  # before its row count is read
    if mask.num_rows != n:
        raise ValueError(f"mask has {mask.num_rows} rows but the shard has {n}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    ids, offsets, rows = mask_csr(mask, n, None, device, op)  # as in _replay
    lengths = offsets[1:] - offsets[:-1]
    nnz = ids.numel()
    t = temperature_per_row(temperature, n, device, allow_zero=False, check_values=True).to(acc)
    mine = (ids >= vocab_start) & (ids < vocab_start + vp)
    where = torch.nonzero(mine)[:, 0]
    x_mine = (entries(rows[where], ids[where] - vocab_start) / t[rows[where]]).double()
    x_local = torch.zeros(nnz, dtype=torch.float64, device=device).index_put((where,), x_mine)
    lse_local = segment_logsumexp(x_mine, rows[where], n)
    held = torch.bincount(rows[where], minlength=n).double()
    local = torch.stack([torch.cat([lse_local, x_local]), torch.cat([held, mine.double()])], 1)
    g = gather_rows(local, group)  # [P, N + nnz, 2]: the one collective
    owners = g[:, n:, 1].detach().sum(0)
    bad = torch.nonzero(owners != 1).flatten()
    if bad.numel():
        r = int(rows[int(bad[0])])
        raise ValueError(f"mask: row {r} holds token ids outside the ranks' shards, or shards overlap "
                         f"(token {int(ids[int(bad[0])])} found in {int(owners[int(bad[0])])} shards; this rank "
                         f"holds [{vocab_start}, {vocab_start + vp}))")
    x = g[:, n:, 0].sum(0)  # one owner per entry: the other ranks add exact zeros
    lse_parts = g[:, :n, 0]
    # a rank holding none of a row has -inf there; a row no rank holds (empty) has no entries
    lse = torch.logsumexp(torch.where(lengths[None, :] == 0, torch.zeros_like(lse_parts), lse_parts), 0)
    return minus_row_lse(x, lse, rows).to(acc)
