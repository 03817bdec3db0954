"""Padded layouts: `ids [N, W]` int32 (row r's support in its first `counts[r]` slots, -1 after)
and `counts [N]` int32, the fixed-width buffers prime-rl and vLLM's compact capture use. A row
with count 0 is an unsampled row (no support recorded; replay falls back there).

Device-agnostic torch: the work stays on the tensors' device.
"""
from __future__ import annotations

from typing import Optional

import torch

from mask_replay.errors import EngineOutputError
from mask_replay.mask import SamplingMask, adapter
from mask_replay.params import INT_DTYPES
from mask_replay.sampler.adapters.common import _OUT_OF_RANGE, INT32_LIMIT

PAD = -1


def padded_width(widest: int, width: Optional[int]) -> int:
    """The width of a padded layout: `width`, checked, or the widest row when None."""
    if width is None:
        width = widest
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an integer >= 0, got {width!r}")
    if width >= INT32_LIMIT:  # a row holds distinct int32 ids: no support is this wide
        raise ValueError(f"width {width} is not below 2^31 (no row can hold more distinct int32 ids)")
    return width


def wider_row(row: int, length: int, width: int) -> ValueError:
    """The error for the first row wider than the width (to_padded and the chunked convert name it alike)."""
    return ValueError(f"row {row} has {length} ids, more than the width {width}")


@adapter("to_padded")
def to_padded(mask, width: Optional[int] = None):
    """(ids [N, width] int32 padded with -1, counts [N] int32), plus, when the mask carries
    entry_logprobs, logprobs [N, width] float32 padded with -inf (probability 0, as prime-rl pads its
    log-probs). width defaults to the widest row; a row wider than `width` is an error naming the
    row and its size."""
    lengths = mask.lengths()
    n = mask.num_rows
    width = padded_width(int(lengths.max()) if n else 0, width)
    wide = torch.nonzero(lengths > width)
    if wide.numel():
        raise wider_row(int(wide[0]), int(lengths[int(wide[0])]), width)
    try:
        ids = torch.full((n, width), PAD, dtype=torch.int32, device=mask.device)
    except (RuntimeError, MemoryError) as exc:  # the allocator's refusal, named by the sizes asked for
        raise ValueError(f"{n} rows x width {width} int32 ids ({4 * n * width:,} bytes) cannot be allocated") from exc
    if mask.nnz:
        rows = mask.row_ids()
        cols = torch.arange(mask.nnz, device=mask.device) - mask.offsets[rows]
        ids[rows, cols] = mask.token_ids
    if mask.entry_logprobs is None:
        return ids, lengths.to(torch.int32)
    lp = torch.full((n, width), float("-inf"), dtype=torch.float32, device=mask.device)
    if mask.nnz:
        lp[rows, cols] = mask.entry_logprobs.to(device=mask.device, dtype=torch.float32)
    return ids, lengths.to(torch.int32), lp


@adapter("from_padded")
def mask_from_padded(ids, counts, *, strict_padding: bool = True, vocab_size: Optional[int] = None,
                source: str = "padded mask", metadata: Optional[dict] = None, entry_logprobs=None, **extras):
    """The mask of a padded layout. Checks: ids 2-D integer, counts [N] integer in [0, W];
    ids in the first counts[r] slots in [0, vocab_size) (or [0, 2^31)) and distinct; with
    `strict_padding` the other slots are -1 (vLLM's compact buffer leaves them unwritten: pass
    False for it). Rows come out sorted. `extras` are per-row tensors (sampled, logprobs, ...);
    a `sampled` token must lie in its row unless the row is empty. `entry_logprobs` [N, W] (floating,
    slots like ids; padding not read) become the mask's entry_logprobs, sorted with the ids."""
    ids = _int_tensor(ids, "ids", 2, source)
    counts = _int_tensor(counts, "counts", 1, source).to(ids.device)
    n, w = check_layout(ids, counts, entry_logprobs, extras, source)
    check_counts(counts, w, source)
    ids = ids.to(torch.int64)
    valid = torch.arange(w, device=ids.device)[None, :] < counts[:, None]
    # int32 ids whatever vocab_size says: a larger one would let 2^32 + 5 through, to wrap to 5 in the cast
    limit = min(vocab_size, INT32_LIMIT) if vocab_size is not None else INT32_LIMIT
    bad = torch.nonzero(valid & ((ids < 0) | (ids >= limit)))
    if bad.numel():
        r, s = (int(x) for x in bad[0])
        raise EngineOutputError(f"{source}: row {{row}} slot {s}: id {int(ids[r, s])} is out of range [0, {limit})",
                                row=r)
    if strict_padding:
        bad = torch.nonzero(~valid & (ids != PAD))
        if bad.numel():
            r, s = (int(x) for x in bad[0])
            raise EngineOutputError(f"{source}: row {{row}} slot {s}: padding past count {int(counts[r])} must be "
                                    f"{PAD}, got {int(ids[r, s])}", row=r)
    # sort each row's valid prefix (padding pushed past it), then check distinctness
    keyed = torch.where(valid, ids, torch.full_like(ids, INT32_LIMIT))
    keyed, perm = torch.sort(keyed, dim=1)
    if w > 1:
        bad = torch.nonzero(valid[:, 1:] & (keyed[:, 1:] == keyed[:, :-1]))
        if bad.numel():
            r, s = (int(x) for x in bad[0])
            raise EngineOutputError(f"{source}: row {{row}}: id {int(keyed[r, s])} appears twice", row=r)
    token_ids = keyed[valid].to(torch.int32)  # valid slots are each row's prefix, so order holds
    entries = None
    if entry_logprobs is not None:
        entries = entry_logprobs.to(ids.device).gather(1, perm)[valid]
        # a float64 value beyond float32 would become +-inf silently (-1e300 a probability 0): refused,
        # as the JSON adapters refuse it
        wide = torch.nonzero(torch.isfinite(entries) & torch.isinf(entries.to(torch.float32)))
        if wide.numel():
            i = int(wide[0])
            raise EngineOutputError(f"{source}: row {{row}}: entry log-prob {float(entries[i]):g} {_OUT_OF_RANGE}",
                                    row=int(torch.nonzero(valid)[i, 0]))
        entries = entries.to(torch.float32)
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    sampled = extras.get("sampled")
    if sampled is not None:
        s = sampled.to(device=ids.device, dtype=torch.int64)
        hit = (keyed == s[:, None]) & valid
        bad = torch.nonzero(~hit.any(dim=1) & (counts > 0))
        if bad.numel():
            r = int(bad[0])
            raise EngineOutputError(f"{source}: row {{row}}: sampled token {int(s[r])} is not among its "
                                    f"{int(counts[r])} ids", row=r)
    named = {k: extras.pop(k) for k in ("sampled", "logprobs", "kept_mass") if k in extras}
    mask = SamplingMask(token_ids, offsets, extras=extras, metadata=dict(metadata or {}), entry_logprobs=entries,
                        **named)
    if entries is not None:
        mask.validate(source=source)
    return mask


def check_layout(ids: torch.Tensor, counts: torch.Tensor, entry_logprobs, extras: dict, source: str):
    """(N, W) of integer `ids` and `counts`, after the checks that need only dtypes and shapes (meta
    tensors will do: the chunked convert makes them before reading any row): counts [N],
    entry_logprobs floating [N, W], every extra a tensor [N] not named like a CSR key."""
    n, w = _int_tensor(ids, "ids", 2, source).shape
    _int_tensor(counts, "counts", 1, source)
    if counts.numel() != n:
        raise EngineOutputError(f"{source}: counts has {counts.numel()} entries for {n} rows of ids")
    if entry_logprobs is not None and (not isinstance(entry_logprobs, torch.Tensor)
                                       or not entry_logprobs.is_floating_point()
                                       or tuple(entry_logprobs.shape) != (n, w)):
        got = f"{entry_logprobs.dtype} {tuple(entry_logprobs.shape)}" if isinstance(entry_logprobs, torch.Tensor) \
            else type(entry_logprobs).__name__
        raise EngineOutputError(f"{source}: entry_logprobs must be a floating tensor of shape [{n}, {w}] "
                                f"(like ids), got {got}")
    for name, v in extras.items():
        if name in ("token_ids", "offsets"):
            raise EngineOutputError(f"{source}: {name} is the mask's own CSR key, not a per-row extra")
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != n:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise EngineOutputError(f"{source}: {name} must be a tensor of shape [{n}], got {shape}")
    return n, w


def check_counts(counts: torch.Tensor, width: int, source: str) -> None:
    """Every count in [0, width]; EngineOutputError naming the first row outside (its `row` field, so
    that a caller reading rows a..b shifts it with .at(row_offset=a))."""
    bad = torch.nonzero((counts < 0) | (counts > width))
    if bad.numel():
        r = int(bad[0])
        raise EngineOutputError(f"{source}: row {{row}}: count {int(counts[r])} is outside [0, {width}] "
                                f"(width {width})", row=r)


def _int_tensor(x, name, dim, source):
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise EngineOutputError(f"{source}: {name} is not an integer array ({exc})") from exc
    if x.dtype not in INT_DTYPES or x.dim() != dim:
        raise EngineOutputError(f"{source}: {name} must be a {dim}-D integer tensor, got {x.dtype} {tuple(x.shape)}")
    return x
