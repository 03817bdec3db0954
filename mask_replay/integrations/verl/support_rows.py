"""Where each recorded support row lands in verl's packed log-prob layout (pure torch, no verl import).

verl's FSDP engine (0.9.1, workers/engine/fsdp/transformer_impl.py, FSDPEngineWithLMHead) packs a
micro-batch's samples end to end (prompt + response each, no padding between them), rolls the labels
by one (position p predicts token p + 1), appends a tail pad (the static bucket pad plus the Ulysses
pad, both at the end of the global sequence) and, with Ulysses sequence parallelism of size S, gives
rank r the contiguous slice [r * L / S, (r + 1) * L / S) of the padded length L. Response token j of
sample i (prompt length P_i) is therefore predicted at global packed position cu_i + P_i + j - 1.

Per sample the supports arrive as one CSR each (rows = that sample's response tokens, ids ascending
within a row). A row that is empty (nothing recorded: a tool token, an engine that could not record)
or holds the whole vocabulary keeps verl's own log-prob, bit for bit; every other row is replayed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mask_replay import csr
from mask_replay.errors import InputError, MaskFormatError, OutsideSupportError
from mask_replay.mask import SamplingMask

__all__ = ["SUPPORT_KEY", "LocalSupport", "SampleRows", "sample_support", "recorded_rows", "local_support"]

SUPPORT_KEY = "sampling_support"  # the per-sample key in TokenOutput.extra_fields and non_tensor_batch


@dataclass
class LocalSupport:
    """The replayed rows of one rank's slice of a packed micro-batch.

    positions int64 [R]: local positions (into this rank's logits rows), ascending; mask: R rows in
    that order, ``mask.sampled`` the response token each row must predict."""

    positions: torch.Tensor
    mask: SamplingMask
    local_length: int

    def keep(self, device) -> torch.Tensor:
        """bool [local_length], True at the replayed positions."""
        keep = torch.zeros(self.local_length, dtype=torch.bool, device=device)
        keep[self.positions.to(device)] = True
        return keep


def sample_support(support: Any, sample: int, vocab_size: Optional[int] = None) -> Optional[SamplingMask]:
    """One sample's recorded support as a validated SamplingMask, or None when nothing was recorded.

    Accepts a SamplingMask, an object with ``token_ids`` and ``offsets`` attributes (the vLLM
    plugin's record), or a dict with those keys; numpy or torch arrays."""
    if support is None:
        return None
    if isinstance(support, SamplingMask):
        ids, offsets = support.token_ids, support.offsets
    elif isinstance(support, dict) and "token_ids" in support and "offsets" in support:
        ids, offsets = support["token_ids"], support["offsets"]
    elif hasattr(support, "token_ids") and hasattr(support, "offsets"):
        ids, offsets = support.token_ids, support.offsets
    else:
        raise InputError(f"sample {sample}: {SUPPORT_KEY} must hold token_ids and offsets, got "
                         f"{type(support).__name__}", key=SUPPORT_KEY)
    try:  # checked as given, then cast: int64 / uint64 ids of 2^32 + 5 must not wrap into range
        return SamplingMask(*csr.checked_csr(ids, offsets, source=f"{SUPPORT_KEY} of sample {sample}",
                                             vocab_size=vocab_size))
    except MaskFormatError as exc:
        raise InputError(str(exc), key=SUPPORT_KEY) from None


@dataclass
class SampleRows:
    """One sample's replayed rows: ``rows`` int64 [R] (response positions, ascending, each recorded:
    neither empty nor the whole vocabulary), ``start`` the packed position of its first response token,
    ``mask`` its whole validated support, ``tokens`` int64 its response tokens."""

    rows: torch.Tensor
    start: int
    mask: SamplingMask
    tokens: torch.Tensor

    def select(self, which: torch.Tensor) -> SamplingMask:
        """The support rows ``self.rows[which]`` (bool or index), ``sampled`` their response tokens."""
        rows = self.rows[which]
        tok, off = csr.take_rows(self.mask.token_ids, self.mask.offsets, rows)
        return SamplingMask(tok, off, sampled=self.tokens[rows])


def recorded_rows(support: Any, sample: int, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  response_lengths: torch.Tensor, vocab_size: int) -> Optional[SampleRows]:
    """Sample ``sample``'s recorded rows, validated against its response tokens; None when it has none.

    input_ids [total] the packed, unpadded token ids; cu_seqlens [B + 1]; response_lengths [B]. A support
    whose rows do not match the response (row count, or a response token outside its non-empty row) is
    one error naming the sample and the position. (Tensors already on the CPU are not copied: a caller
    looping over samples converts them once.)"""
    mask = sample_support(support, sample, vocab_size)
    if mask is None:
        return None
    cu = cu_seqlens.detach().cpu().to(torch.int64)
    r = int(response_lengths[sample])
    if mask.num_rows != r:
        raise InputError(f"sample {sample}: the support has {mask.num_rows} rows but the response has {r} tokens "
                         f"(response position {min(mask.num_rows, r)} has no match)", key=SUPPORT_KEY,
                         hint="every response token needs its row, an empty one where nobody sampled it (verl's "
                              "agent loops get them from MASK_REPLAY_VERL=1 in the agent-loop workers)")
    start = int(cu[sample + 1]) - r  # the first response token's position in the packed sequence
    if start <= int(cu[sample]):
        raise InputError(f"sample {sample}: no prompt token before the response (verl predicts response token 0 "
                         "from the last prompt token)")
    tokens = input_ids.detach().cpu().to(torch.int64)[start:start + r]
    lengths = mask.lengths()
    recorded = torch.nonzero((lengths > 0) & (lengths < vocab_size)).flatten()
    if recorded.numel() == 0:
        return None
    _check_sampled(mask, tokens, recorded, sample)
    return SampleRows(recorded, start, mask, tokens)


def local_support(supports: Sequence[Any], input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  response_lengths: torch.Tensor, *, vocab_size: int, pad_size: int = 0, sp_rank: int = 0,
                  sp_size: int = 1) -> LocalSupport:
    """The replayed rows of rank ``sp_rank``'s slice of the packed micro-batch.

    supports: one entry per sample (see ``sample_support``); input_ids [total] the packed, unpadded
    token ids; cu_seqlens [B + 1]; response_lengths [B]; pad_size the tail pad verl appended to the
    global packed sequence. A sample whose support rows do not match its response tokens (row count,
    or a response token outside its non-empty row) is one error naming the sample and the position.
    """
    cu = cu_seqlens.detach().cpu().to(torch.int64)
    resp = response_lengths.detach().cpu().to(torch.int64)
    ids = input_ids.detach().cpu().to(torch.int64)
    b = cu.numel() - 1
    if len(supports) != b:
        raise InputError(f"{len(supports)} supports for a micro-batch of {b} samples", key=SUPPORT_KEY)
    total = int(cu[-1])
    padded = total + int(pad_size)
    if padded % sp_size:
        raise InputError(f"packed length {total} + pad {pad_size} is not divisible by sequence parallel size "
                         f"{sp_size}")
    chunk = padded // sp_size
    lo, hi = sp_rank * chunk, (sp_rank + 1) * chunk
    positions, masks = [], []
    for i, support in enumerate(supports):
        found = recorded_rows(support, i, ids, cu, resp, vocab_size)
        if found is None:
            continue
        pos = found.start - 1 + found.rows  # global packed position predicting each recorded response token
        here = (pos >= lo) & (pos < hi)
        if not bool(here.any()):
            continue
        masks.append(found.select(here))
        positions.append(pos[here] - lo)
    mask = SamplingMask.concat(masks) if masks else SamplingMask(
        torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), sampled=torch.zeros(0, dtype=torch.int64))
    if masks:
        mask.sampled = torch.cat([m.sampled for m in masks])
    pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
    return LocalSupport(pos, mask, chunk)


def _check_sampled(mask: SamplingMask, tokens: torch.Tensor, rows: torch.Tensor, sample: int) -> None:
    """Every recorded row holds its response token (ids ascending: one searchsorted per row)."""
    src, offsets = csr.take_row_entries(mask.offsets, rows)
    row_of = torch.repeat_interleave(torch.arange(rows.numel()), offsets.diff(), output_size=src.numel())
    found = (mask.token_ids[src].to(torch.int64) == tokens[rows][row_of]).to(torch.int64)
    hit = torch.zeros(rows.numel(), dtype=torch.int64).index_add_(0, row_of, found) > 0
    if not bool(hit.all()):
        j = int(rows[torch.nonzero(~hit)[0, 0]])
        raise OutsideSupportError(f"sample {sample}, response position {j}: token {int(tokens[j])} is not in its "
                                  f"recorded support ({int(mask.lengths()[j])} ids)", key=SUPPORT_KEY)
