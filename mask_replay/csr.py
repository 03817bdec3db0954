"""The CSR support: its contract, checked in one place with one set of messages, and the O(nnz)
building blocks over it in plain device-agnostic torch (CPU and CUDA).

A support is `token_ids` (int32 [nnz], strictly ascending within a row) and `offsets` (int64
[N + 1], offsets[0] = 0, non-decreasing, offsets[N] = nnz). The sparse statistics (support_stats.py)
and the sparse-gradient LM head (sparse_head.py) are compositions of the segment reductions below:
gather the support's logits, then reduce per row. Nothing here touches an [N, V] tensor.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from mask_replay.errors import MaskFormatError

INT32_LIMIT = 2**31  # token_ids are int32: with no vocabulary given, an id must lie in [0, 2^31)


def exact_int64(values: Any, *, name: str, source: str) -> torch.Tensor:
    """A support's ids or offsets as they arrive (a list, tuple, numpy array or tensor of any integer
    dtype) as a 1-D int64 CPU tensor of the same numbers, to be checked before any narrowing cast: a
    cast to int32 first would wrap 2^32 + 5 to 5 and let it pass. An empty sequence of any dtype is
    an empty one (JSON's [] reads back as float64). Floats, bools, strings, another rank, or a value
    beyond int64 (uint64 from 2^63, a Python int wider still) raise MaskFormatError."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dim() == 1 and values.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise MaskFormatError(f"{name} must be a 1-D integer array, got {values.dtype} {tuple(values.shape)}",
                                  file=source)
        values = values.numpy()  # every integer dtype torch has, uint64 included, has a numpy twin
    elif not isinstance(values, (np.ndarray, list, tuple)):
        raise MaskFormatError(f"{name} must be an array, got {type(values).__name__}", file=source)
    try:
        a = np.asarray(values)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise MaskFormatError(f"{name} must be a 1-D integer array ({exc})", file=source) from None
    if a.ndim == 1 and a.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    if a.dtype == object and a.ndim == 1 and all(type(x) is int for x in a.tolist()):
        big = next(x for x in a.tolist() if not -2**63 <= x < 2**63)  # numpy fell back to objects: too wide
        raise MaskFormatError(f"{name} hold {big}, beyond a 64-bit integer", file=source)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise MaskFormatError(f"{name} must be a 1-D integer array, got {a.dtype} {a.shape}", file=source)
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and bool((a >= 2**63).any()):
        raise MaskFormatError(f"{name} hold {int(a[a >= 2**63][0])}, beyond a 64-bit integer", file=source)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def checked_csr(token_ids: Any, offsets: Any, *, source: str,
                vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids int32, offsets int64) of a support entering from outside (an engine, a rollout
    server, a file, a JSON round trip), in any integer dtype: the contract is checked on the values
    as given (exact_int64), and only then are they cast. MaskFormatError naming the row."""
    ids = exact_int64(token_ids, name="token_ids", source=source)
    offs = exact_int64(offsets, name="offsets", source=source)
    check_offsets(offs, ids.numel(), source=source)
    check_ids(ids, offs, source=source, vocab_size=vocab_size)
    return ids.to(torch.int32), offs


def check_offsets(offsets: torch.Tensor, nnz: int, *, source: str) -> None:
    """offsets must be 1-D int64 [N + 1 >= 1], start at 0, never decrease and end at nnz."""
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise MaskFormatError(f"offsets must be a 1-D int64 tensor of N+1 >= 1 entries, got {offsets.dtype} "
                              f"{tuple(offsets.shape)}", file=source)
    o = offsets.cpu()
    if int(o[0]) != 0:
        raise MaskFormatError(f"offsets[0] must be 0, got {int(o[0])}", file=source)
    bad = torch.nonzero(o[1:] < o[:-1])
    if bad.numel():
        r = int(bad[0])
        raise MaskFormatError(f"offsets decrease at row {{row}} ({int(o[r])} -> {int(o[r + 1])})", file=source, row=r)
    if int(o[-1]) != nnz:
        raise MaskFormatError(f"offsets[-1] = {int(o[-1])} but token_ids has {nnz} entries", file=source)


# A log-prob can pass 0 by rounding (an engine working in bfloat16: half an ulp at 1 is 2^-9), a kept
# mass can pass 1 (float32); beyond these margins the value cannot be one (a log-prob > 0 is a
# probability > 1).
LOGPROB_MARGIN = 1e-2
KEPT_MASS_MARGIN = 1e-4


def impossible_values(name: str, values: torch.Tensor) -> Optional[tuple[int, str]]:
    """(first row, what must hold) where a per-row value cannot be right, or None. logprobs: <= 0,
    NaN allowed (a row with no log-prob), -inf allowed; kept_mass: in [0, 1], NaN allowed."""
    v = values.detach().cpu().double()
    if name in ("logprobs", "capture_logprobs"):
        bad, rule = v > LOGPROB_MARGIN, "a log-prob must be <= 0"
    elif name == "kept_mass":
        bad, rule = (v < 0) | (v > 1 + KEPT_MASS_MARGIN), "a kept mass must lie in [0, 1]"
    else:
        return None
    hit = torch.nonzero(bad)
    return (int(hit[0]), rule) if hit.numel() else None


def check_row_values(values: dict, *, source: str, row_offset: int = 0) -> None:
    """MaskFormatError naming the first row whose logprobs / kept_mass cannot be right."""
    for name, v in values.items():
        if v is None:
            continue
        found = impossible_values(name, v)
        if found is not None:
            r, rule = found
            raise MaskFormatError(f"row {{row}} has {name} {float(v[r].item()):.6g}: {rule}", file=source,
                                  key=name, row=r + row_offset)


def row_of_entry(entry: int, offsets: torch.Tensor) -> int:
    """The row holding entry `entry` of token_ids (offsets on the CPU)."""
    return int(torch.searchsorted(offsets, torch.tensor(entry), right=True)) - 1


def check_ids(token_ids: torch.Tensor, offsets: torch.Tensor, *, source: str, vocab_size: Optional[int] = None) -> None:
    """Every id in [0, vocab_size) ([0, 2^31) when the vocabulary is unknown: an int32 id) and
    strictly ascending within its row; offsets already checked. Any integer dtype (the values are
    compared as int64, never narrowed first). The error names the first bad entry's row, in the
    words the kernels use for the same defect, and the id."""
    t, o = token_ids.cpu().long(), offsets.cpu()
    if not t.numel():
        return
    outside = (t < 0) | (t >= (INT32_LIMIT if vocab_size is None else vocab_size))
    same_row = torch.ones(t.numel() - 1, dtype=torch.bool)
    starts = o[1:-1]
    starts = starts[(starts > 0) & (starts < t.numel())]
    same_row[starts - 1] = False
    descending = torch.zeros(t.numel(), dtype=torch.bool)
    descending[1:] = same_row & (t[1:] <= t[:-1])
    bad = torch.nonzero(outside | descending)
    if not bad.numel():
        return
    e = int(bad[0])
    if bool(outside[e]):
        if vocab_size is None:
            what = "hold a negative id" if int(t[e]) < 0 else "hold an id outside [0, 2^31)"
        else:
            what = f"hold an id outside [0, {vocab_size})"
        what = f"{what} (id {int(t[e])})"
    else:
        what = "are not strictly ascending"
    raise MaskFormatError(f"token_ids of row {{row}} {what}", file=source, row=row_of_entry(e, o))


def check_csr(token_ids: torch.Tensor, offsets: torch.Tensor, *, source: str,
              vocab_size: Optional[int] = None) -> None:
    """The whole contract (dtypes, shapes, offsets, ids), raising MaskFormatError naming the row."""
    if token_ids.dtype != torch.int32 or token_ids.dim() != 1:
        raise MaskFormatError(f"token_ids must be a 1-D int32 tensor, got {token_ids.dtype} "
                              f"{tuple(token_ids.shape)}", file=source)
    check_offsets(offsets, token_ids.numel(), source=source)
    if token_ids.device != offsets.device:
        raise MaskFormatError(f"token_ids on {token_ids.device} but offsets on {offsets.device}", file=source)
    check_ids(token_ids, offsets, source=source, vocab_size=vocab_size)


# How far from 0 (nats) the logsumexp of a row's entry log-probs may be: float32 log-softmax noise is
# ~1e-6 on a 150k vocabulary (the same bound the log-prob mismatch report uses for the sampled token).
ENTRY_LOGPROBS_TOLERANCE = 1e-4


def check_entry_logprobs(values: torch.Tensor, offsets: torch.Tensor, *, source: str,
                         tolerance: float = ENTRY_LOGPROBS_TOLERANCE) -> None:
    """The per-entry log-probs of a support (offsets already checked): floating [nnz], no NaN or
    +inf (-inf is an entry of probability 0), and each non-empty row a distribution over its
    entries: |logsumexp(row)| <= tolerance. MaskFormatError naming the first bad row."""
    nnz = int(offsets[-1])
    if not values.is_floating_point() or values.dim() != 1 or values.numel() != nnz:
        raise MaskFormatError(f"entry_logprobs must be a 1-D floating tensor of {nnz} entries (one per support id), "
                              f"got {values.dtype} {tuple(values.shape)}", file=source)
    if not nnz:
        return
    v, o = values.detach().cpu().double(), offsets.cpu()
    n = o.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n), o[1:] - o[:-1], output_size=nnz)
    bad = torch.nonzero(torch.isnan(v) | torch.isposinf(v))
    if bad.numel():
        e = int(bad[0])
        raise MaskFormatError(f"entry_logprobs of row {{row}} hold {float(v[e])}", file=source,
                              row=int(rows[e]))
    lse = segment_logsumexp(v, rows, n)
    filled = (o[1:] - o[:-1]) > 0
    off = filled & ~(lse.abs() <= tolerance)  # an all -inf row: lse = -inf, not a distribution
    bad = torch.nonzero(off)
    if bad.numel():
        r = int(bad[0])
        raise MaskFormatError(f"entry_logprobs of row {{row}} do not normalise: logsumexp {float(lse[r]):.3g}, "
                              f"more than {tolerance:g} from 0", file=source, row=r)


def device_csr(token_ids: torch.Tensor, offsets: torch.Tensor, n: int, vocab: int, device, op: str):
    """(token_ids int64 [nnz], offsets int64 [n + 1], row of each entry int64 [nnz]) on `device`, after
    checking the contract there: the defects are flagged on the device and read back at once (one
    synchronisation); only a mask found bad is checked again on the host, for the message."""
    ids = token_ids.to(device=device, dtype=torch.int64)
    offs = offsets.to(device=device, dtype=torch.int64)
    nnz = ids.numel()
    lengths = offs[1:] - offs[:-1]
    if bool(torch.stack([offs[0] != 0, (lengths < 0).any(), offs[-1] != nnz]).any()):
        _refuse(token_ids, offsets, vocab, op)
    rows = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=nnz)
    if nnz:
        first = torch.zeros(nnz, dtype=torch.bool, device=device)  # first entry of a row
        inner = offs[1:-1]
        first[inner[inner < nnz]] = True
        first[0] = True
        bad = (ids < 0) | (ids >= vocab)
        bad[1:] |= ~first[1:] & (ids[1:] <= ids[:-1])
        if bool(bad.any()):
            _refuse(token_ids, offsets, vocab, op)
    return ids, offs, rows


def _refuse(token_ids, offsets, vocab: int, op: str):
    """A mask the device found bad: the host check names the defect and its row (on the values as
    given: a cast to int32 first would wrap an id of 2^32 + 5 into range and find nothing)."""
    checked_csr(token_ids, offsets, source=op, vocab_size=vocab)
    raise MaskFormatError("the support is not a valid CSR", file=op)  # unreachable while both checks agree


def take_rows(token_ids: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor):
    """(token_ids, offsets) of the given rows, in the given order (rows int64 on offsets' device)."""
    src, new_offsets = take_row_entries(offsets, rows)
    return token_ids[src], new_offsets


def take_row_entries(offsets: torch.Tensor, rows: torch.Tensor):
    """(entry index of each entry of the result int64, offsets of the result) for the given rows, in
    the given order: gathers token_ids, and any other per-entry column (entry_logprobs) alike."""
    starts, ends = offsets[:-1][rows], offsets[1:][rows]
    lengths = ends - starts
    new_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=offsets.device)
    torch.cumsum(lengths, 0, out=new_offsets[1:])
    nnz = int(new_offsets[-1])
    # entry j of the result comes from starts[row of j] + (j - new_offsets[row of j])
    which = torch.repeat_interleave(torch.arange(rows.numel(), device=offsets.device), lengths, output_size=nnz)
    src = starts[which] + torch.arange(nnz, device=offsets.device) - new_offsets[:-1][which]
    return src, new_offsets


def segment_logsumexp(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """logsumexp of x over each row's entries ([n]); -inf for a row that is empty or all -inf.

    The shift m is the row max taken without gradient: lse = m + log sum exp(x - m) has the
    right gradient for any constant m, and a row whose max is not finite is shifted by 0 so that
    no inf - inf appears (its lse is then -inf, +inf or NaN, as the values say)."""
    m = torch.full((n,), float("-inf"), dtype=x.dtype, device=x.device)
    m = m.scatter_reduce(0, rows, x.detach(), reduce="amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, rows, torch.exp(x - m[rows]))
    # s = 0 (nothing finite) is -inf, selected after the log of a stand-in 1: log(0) would send
    # 0 * inf = NaN back through its gradient.
    none = s == 0
    lse = m + torch.log(torch.where(none, torch.ones_like(s), s))
    return torch.where(none, torch.full_like(s, float("-inf")), lse)


def segment_sum(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def log_probs_over_support(x: torch.Tensor, rows: torch.Tensor, n: int):
    """(log q [nnz], q [nnz], positive [nnz], alive [n]): the support's log-softmax per row.
    alive is False for a row that is empty or whose logits in K are all -inf: it has no
    distribution. Entries with q = 0 (positive False: a -inf logit, or a dead row) get log q = 0,
    a stand-in, so that nothing downstream (values or gradients) becomes NaN; callers that need
    the true -inf read `positive`."""
    lse = segment_logsumexp(x, rows, n)
    alive = lse != float("-inf")  # NaN rows stay alive: their NaN must reach the result
    entry_alive = alive[rows] & (x > float("-inf"))
    safe_lse = torch.where(alive, lse, torch.zeros_like(lse))
    logq = torch.where(entry_alive, x - safe_lse[rows], torch.zeros_like(x))
    q = torch.where(entry_alive, torch.exp(logq), torch.zeros_like(x))
    return logq, q, entry_alive, alive




def support_log_softmax(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """x_e - logsumexp_{j in row(e)} x_j for every entry ([nnz], x's dtype), with the reduction in
    float64 and the result rounded once: the one definition of a support's per-entry log-probs
    (capture's entry_logprobs, the trainer's replay_support_logprobs). An entry whose x is -inf
    gets -inf (probability 0, gradient 0), also in a row that has nothing finite; NaN stays NaN.
    Differentiable: d out_e / d x_j = 1[e = j] - q_j within a row, 0 across rows."""
    x64 = x.double()
    return minus_row_lse(x64, segment_logsumexp(x64, rows, n), rows).to(x.dtype)


def minus_row_lse(x: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x_e - lse[row e], -inf where x_e is -inf (no inf - inf, and a zero gradient there)."""
    dead = x == float("-inf")
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[rows]
    return torch.where(dead, torch.full_like(x, float("-inf")), x - torch.where(dead, safe, lse[rows]))
