"""What every engine profile shares: parameter checks, temperature scaling, greedy rows, CSR output.

The profiles reproduce an engine's float arithmetic, so they are written with the same torch
operations the engines use (softmax, cumsum, sort in float32). That is deliberate: a sort-free or
exact-arithmetic rewrite would be "better" and would disagree with the engine on exactly the rows
a profile exists for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mask_replay.params import Param, expand_params

NEG_INF = float("-inf")


@dataclass
class RowParams:
    """Per-row parameters plus which ones the caller set at all: several engines behave differently
    when a filter is off for the whole batch than when a row carries its neutral value (vLLM runs
    its top-p pass, with its fp32 underflow masking, as soon as any row uses top-p)."""

    temperature: torch.Tensor  # f32 [N]
    top_k: torch.Tensor  # i64 [N], <= 0: off
    top_p: torch.Tensor  # f64 [N], 1: off
    min_p: torch.Tensor  # f64 [N], 0: off
    uses_top_k: bool
    uses_top_p: bool
    uses_min_p: bool
    temperature_scalar: Optional[float] = None  # the Python number, when the caller gave one


def row_params(n: int, device, temperature: Param, top_k: Param, top_p: Param, min_p: Param) -> RowParams:
    t, k, p, mp = expand_params(n, device, temperature, top_k, top_p, min_p)
    for name, v, bad, want in (
        ("temperature", t, ~torch.isfinite(t) | (t < 0), "finite and >= 0"),
        ("top_p", p, ~((p > 0) & (p <= 1)), "in (0, 1]"),
        ("min_p", mp, ~((mp >= 0) & (mp <= 1)), "in [0, 1]"),
    ):
        if n and bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name} must be {want}, got {float(v[r])} in row {r}")
    scalar = float(temperature) if isinstance(temperature, (int, float)) else None
    return RowParams(t, k, p, mp, top_k is not None, top_p is not None, min_p is not None, scalar)


def check_logits(logits: torch.Tensor) -> None:
    """NaN and +inf are errors (as in the exact profile); -inf is a token that cannot be drawn."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    bad = torch.isnan(logits) | (logits == float("inf"))
    if bool(bad.any()):
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"logits: {float(logits[r, c])} at row {r}, column {c}")


def scaled(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, scalar=None) -> torch.Tensor:
    """float32 logits divided by float32 T (the engines upcast first, then divide); greedy rows are
    left unscaled (their support is decided by argmax alone). With `scalar` (a Python number, as
    transformers divides) the division is tensor-by-scalar, which CUDA computes as a multiplication
    by the reciprocal: same operation, same bits as the engine on the same device."""
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    if scalar is not None and scalar > 0:
        x = logits.to(torch.float32) / scalar if scalar != 1 else logits.to(torch.float32)
    else:
        x = logits.to(torch.float32) / t.unsqueeze(1)
    if bool(torch.isinf(x).logical_and(x > 0).any()):
        r, c = (int(i) for i in torch.nonzero(torch.isinf(x) & (x > 0))[0])
        raise ValueError(f"logits: row {r}, column {c} overflows to +inf at temperature {float(t[r])}")
    return x


def greedy_keep(logits: torch.Tensor, greedy: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Greedy rows keep the first index of the maximum (torch.argmax, as the engines take it)."""
    if not bool(greedy.any()):
        return keep
    one = torch.zeros_like(keep)
    rows = torch.nonzero(greedy).flatten()
    sub = logits[rows].to(torch.float32)
    finite = torch.isfinite(sub).any(1)
    one[rows[finite], sub[finite].argmax(1)] = True
    return torch.where(greedy.unsqueeze(1), one, keep)


def effective_k(k: torch.Tensor, vocab: int, off: int) -> torch.Tensor:
    """k <= 0 means off; the value an engine stores for 'off' differs (vLLM: vocab, SGLang: 1 << 30)."""
    return torch.where(k <= 0, torch.full_like(k, off), k)


def batch_of(n: int, batch: Optional[torch.Tensor], device) -> torch.Tensor:
    """Engine batch index of each row (int64 [N], 0..B-1): `batch` ids as given (rows with one value
    were sampled in one engine step), or one batch for all rows."""
    if batch is None:
        return torch.zeros(n, dtype=torch.int64, device=device)
    if not isinstance(batch, torch.Tensor) or batch.shape != (n,) or batch.is_floating_point() \
            or batch.dtype == torch.bool:
        raise ValueError(f"batch must be an integer tensor of shape [{n}] (engine batch of each row)")
    return torch.unique(batch.to(device=device, dtype=torch.int64), return_inverse=True)[1]


def per_batch_any(flag: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """For each row, whether `flag` holds for some row of its engine batch (bool [N])."""
    if not flag.numel():
        return flag
    hits = torch.zeros(int(batch.max()) + 1, dtype=torch.int64, device=flag.device)
    hits.index_add_(0, batch, flag.to(torch.int64))
    return hits[batch] > 0


def per_batch_all(flag: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return ~per_batch_any(~flag, batch)


def per_batch_max(values: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """For each row, the largest of `values` over its engine batch."""
    if not values.numel():
        return values
    out = torch.full((int(batch.max()) + 1,), torch.iinfo(values.dtype).min, dtype=values.dtype,
                     device=values.device)
    out.scatter_reduce_(0, batch, values, reduce="amax")
    return out[batch]


def by_group(x: torch.Tensor, keys: torch.Tensor, run) -> torch.Tensor:
    """`run(x[rows], key)` for each distinct per-row key (int64 [N]) over that key's rows, results put
    back in row order: a row's support then depends on its own logits and its key only, never on
    which other rows share the call."""
    out = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    for key in torch.unique(keys).tolist():
        rows = torch.nonzero(keys == key).flatten()
        out[rows] = run(x[rows], rows, int(key))
    return out


def keep_to_csr(keep: torch.Tensor):
    """Boolean [N, V] -> (token_ids int32 ascending within each row, offsets int64)."""
    counts = keep.sum(1, dtype=torch.int64)
    offsets = torch.zeros(keep.shape[0] + 1, dtype=torch.int64, device=keep.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    token_ids = torch.nonzero(keep)[:, 1].to(torch.int32)  # row-major, so ids ascend within a row
    return token_ids, offsets


def log_normaliser(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the full vocabulary (float64, rounded once), for kept_mass."""
    return torch.logsumexp(x.double(), dim=1).float()

