"""O(nnz) building blocks over a CSR support, in plain device-agnostic torch (CPU and CUDA).

The sparse statistics (support_stats.py) and the sparse-gradient LM head (sparse_head.py) are
compositions of these: gather the support's logits, then reduce per row with index_add /
scatter_reduce. Autograd differentiates them; nothing here touches an [N, V] tensor.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay.mask import SamplingMask
from mask_replay.params import check_numeric_tensor, is_number


def csr(mask: SamplingMask, n: int, vocab: int, device, op: str):
    """(token_ids int64 [nnz], offsets int64 [n + 1], row of each entry int64 [nnz]) on device,
    after checking the mask against n rows and a vocabulary of `vocab` (two host syncs)."""
    if not isinstance(mask, SamplingMask):
        raise TypeError(f"{op}: mask must be a SamplingMask, got {type(mask).__name__}")
    if mask.num_rows != n:
        raise ValueError(f"{op}: the mask has {mask.num_rows} rows but there are {n} rows of logits")
    ids = mask.token_ids.to(device=device, dtype=torch.int64)
    offsets = mask.offsets.to(device=device, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    nnz = ids.numel()
    # One flag per defect of the offsets, read back at once (one synchronisation).
    flags = torch.stack([
        offsets[0] != 0,
        (lengths < 0).any(),
        offsets[-1] != nnz,
    ])
    if bool(flags.any()):
        raise ValueError(f"{op}: the mask's offsets are not a valid CSR over {nnz} token ids "
                         f"(offsets[0] = {int(offsets[0])}, offsets[-1] = {int(offsets[-1])}, "
                         f"decreasing: {bool(flags[1])})")
    rows = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=nnz)
    if nnz:
        starts = torch.zeros(nnz, dtype=torch.bool, device=device)  # first entry of a row
        inner = offsets[1:-1]
        starts[inner[inner < nnz]] = True
        starts[0] = True
        bad = (ids < 0) | (ids >= vocab)
        bad[1:] |= ~starts[1:] & (ids[1:] <= ids[:-1])
        if bool(bad.any()):
            e = int(torch.nonzero(bad)[0])
            r = int(rows[e])
            what = (f"an id outside [0, {vocab})" if not 0 <= int(ids[e]) < vocab
                    else "ids that are not strictly ascending")
            raise ValueError(f"{op}: token_ids of row {r} hold {what}")
    return ids, offsets, rows


def row_temperature(temperature, n: int, device, op: str) -> torch.Tensor:
    """Per-row float32 [n] temperature, every value finite and > 0 (the error names the row)."""
    if isinstance(temperature, torch.Tensor):
        check_numeric_tensor(f"{op}: temperature", temperature)  # as replay's [N, V] path (params.py)
        t = temperature.detach()
        if t.dim() == 0:
            t = t.reshape(1).expand(n)
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{op}: temperature must be a scalar or a tensor of shape [{n}], got {tuple(t.shape)}")
        t = t.to(device=device, dtype=torch.float32)
    elif not is_number(temperature):  # numpy scalars too, as replay's dense path (params.py) takes them
        raise TypeError(f"{op}: temperature must be a number or a tensor, got {type(temperature).__name__}")
    else:
        t = torch.full((n,), float(temperature), dtype=torch.float32, device=device)
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        r = int(torch.nonzero(bad)[0])
        raise ValueError(f"{op}: temperature must be finite and > 0, row {r} has {float(t[r])}")
    return t


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for fp32/bf16/fp16, fp64 kept (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def output_dtype(out_dtype: Optional[torch.dtype], input_dtype: torch.dtype, op: str) -> torch.dtype:
    """The documented output choices: float32 by default (float64 for float64 input), or the
    input's own dtype, or float64."""
    default = compute_dtype(input_dtype)
    if out_dtype is None:
        return default
    if out_dtype not in (torch.float32, torch.float64, input_dtype):
        raise ValueError(f"{op}: out_dtype must be None, torch.float32, torch.float64 or the input dtype "
                         f"({input_dtype}), got {out_dtype}")
    return out_dtype
