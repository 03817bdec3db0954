"""The support rows as extra int32 columns of vLLM's log-prob token-id tensor, and back.

vLLM moves a step's sampled-token log-probs from the sampler to the API process as a `LogprobsTensors`
whose `logprob_token_ids` is int32 [rows, N + 1]; nothing on the way (device-to-host copy, scheduler
slicing by row, msgpack between processes) depends on its width. The sampler patch appends one block
of columns per row, so the ids tensor becomes wider than the log-prob tensor beside it: the API side
takes the columns past the log-probs' width as the block. One block per row (int32):

    [V, H, payload...]      V = the sampler's vocabulary width (logits.shape[-1])
    H >= 0                  the support is the H ids in payload[:H], ascending (the rest is -1)
    H == BITMASK            payload[:ceil(V / 32)] is a bitmask: bit j of word w is id 32 w + j
    H == WHOLE              the support is every id in [0, V) (no payload)

A row takes the id list when it is no longer than the bitmask (H <= ceil(V / 32) words), so a row costs
4 * min(|support|, V / 32) + 8 bytes; all rows of a step share the widest row's payload width. Greedy
rows are the sampled token alone. Pure torch and numpy: no vLLM import (the patches in this package
call it, the tests feed it tensors).
"""
from __future__ import annotations

import numpy as np
import torch

from mask_replay.errors import EngineOutputError
from mask_replay.sampler.adapters.vllm_support import SupportRows

BITMASK = -1
WHOLE = -2
HEADER = 2  # V and H


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def encode(support: torch.Tensor, sampled: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B, HEADER + W]: the blocks of `support` (bool [B, V], True where the sampler could draw),
    `greedy` rows (bool [B], or None) replaced by their `sampled` id alone."""
    rows, vocab = support.shape
    device = support.device
    if greedy is not None:
        support = support & ~greedy[:, None]
        support[torch.arange(rows, device=device), sampled.long()] |= greedy
    counts = support.sum(1)
    words = bitmask_words(vocab)
    whole = counts == vocab
    as_bits = (counts > words) & ~whole
    as_ids = ~as_bits & ~whole
    # the one host sync of a step: the widest id list, and whether any row takes the bitmask
    widest_list, any_bits = torch.stack([torch.where(as_ids, counts, 0).max(), as_bits.any().long()]).tolist()
    width = words if any_bits else widest_list
    out = torch.full((rows, HEADER + width), -1, dtype=torch.int32, device=device)
    out[:, 0] = vocab
    out[:, 1] = torch.where(whole, WHOLE, torch.where(as_bits, BITMASK, counts)).to(torch.int32)
    if widest_list:
        r, c = torch.nonzero(support & as_ids[:, None], as_tuple=True)  # row-major: ids ascending per row
        starts = torch.cumsum(counts * as_ids, 0) - counts * as_ids
        out[r, HEADER + (torch.arange(r.numel(), device=device) - starts[r])] = c.to(torch.int32)
    if any_bits:
        out[as_bits, HEADER:HEADER + words] = _pack_bits(support[as_bits], words)
    return out


def _pack_bits(bits: torch.Tensor, words: int) -> torch.Tensor:
    """bool [R, V] -> int32 [R, words], bit j of word w = column 32 w + j (two's complement words)."""
    padded = torch.zeros((bits.shape[0], words * 32), dtype=torch.int64, device=bits.device)
    padded[:, :bits.shape[1]] = bits
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=bits.device),
                                       torch.arange(32, device=bits.device))
    packed = (padded.view(-1, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def decode(blocks: np.ndarray) -> list[np.ndarray]:
    """The support ids (int32, ascending) of each block row of `blocks` (int32 [n, HEADER + W])."""
    out = []
    for r, block in enumerate(np.asarray(blocks)):
        vocab, head = int(block[0]), int(block[1])
        if vocab < 1:
            raise EngineOutputError(f"support block {r}: vocabulary width {vocab}")
        if head == WHOLE:
            out.append(np.arange(vocab, dtype=np.int32))
        elif head == BITMASK:
            words = block[HEADER:HEADER + bitmask_words(vocab)]
            bits = np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little")[:vocab]
            out.append(np.flatnonzero(bits).astype(np.int32))
        elif 0 <= head <= block.size - HEADER:
            out.append(block[HEADER:HEADER + head].astype(np.int32))
        else:
            raise EngineOutputError(f"support block {r}: header {head} for {block.size - HEADER} payload columns")
    return out


class RowBuffer:
    """One request's rows so far, appended step by step into arrays that grow by doubling.

    ``rows(start, stop)`` hands out rows [start, stop) as a SupportRows; rows [0, stop) are views of the
    buffer (never copied: a streamed request, whose every output carries all rows so far, costs O(T) in
    all rather than O(T^2)). Appending never changes what an earlier view shows: it writes past the
    filled part, and growing moves to new arrays while old views keep the old ones."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._ids = np.zeros(64, dtype=np.int32)
        self._offsets = np.zeros(17, dtype=np.int64)
        self.num_rows = 0

    def extend(self, rows: list[np.ndarray]) -> None:
        nnz = int(self._offsets[self.num_rows])
        need_ids = nnz + sum(r.size for r in rows)
        need_rows = self.num_rows + len(rows) + 1
        if need_ids > self._ids.size:
            self._ids = _grown(self._ids, need_ids, nnz)
        if need_rows > self._offsets.size:
            self._offsets = _grown(self._offsets, need_rows, self.num_rows + 1)
        for row in rows:
            self._ids[nnz:nnz + row.size] = row
            nnz += row.size
            self.num_rows += 1
            self._offsets[self.num_rows] = nnz

    def rows(self, start: int = 0, stop: int | None = None) -> SupportRows:
        stop = self.num_rows if stop is None else stop
        lo, hi = int(self._offsets[start]), int(self._offsets[stop])
        offsets = self._offsets[start:stop + 1]
        return SupportRows(self._ids[lo:hi], offsets - lo if lo else offsets, self.vocab_size)


def _grown(values: np.ndarray, need: int, filled: int) -> np.ndarray:
    grown = np.zeros(max(need, 2 * values.size), dtype=values.dtype)
    grown[:filled] = values[:filled]
    return grown


def join(rows: list[np.ndarray], vocab_size: int) -> SupportRows:
    """Per-token id arrays as one SupportRows."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    if rows:
        np.cumsum([r.size for r in rows], out=offsets[1:])
    ids = np.concatenate(rows).astype(np.int32, copy=False) if rows else np.zeros(0, dtype=np.int32)
    return SupportRows(ids, offsets, vocab_size)
