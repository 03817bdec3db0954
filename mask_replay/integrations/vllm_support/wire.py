"""The support rows as extra int32 columns of vLLM's log-prob token-id tensor, and back.

vLLM moves a step's sampled-token log-probs from the sampler to the API process as a `LogprobsTensors`
whose `logprob_token_ids` is int32 [rows, N + 1]; nothing on the way (device-to-host copy, scheduler
slicing by row, msgpack between processes) depends on its width. The sampler patch appends one block
of columns per row, so the ids tensor becomes wider than the log-prob tensor beside it: the API side
takes the columns past the log-probs' width as the block. One block per row (int32):

    [V, H, payload...]      V = the sampler's vocabulary width (logits.shape[-1])
    H >= 0                  the support is the H ids in payload[:H], ascending
    H == BITMASK            payload[:ceil(V / 32)] is a bitmask: bit j of word w is id 32 w + j
    H == WHOLE              the support is every id in [0, V) (no payload)

A row takes the id list when it is no longer than the bitmask (H <= ceil(V / 32) words), so a row needs
4 * min(|support|, V / 32) + 8 bytes; greedy rows are the sampled token alone. The words are int32 whatever
the id tensor: where it is int64 (Model Runner V2's) two words share a column bit for bit (`as_columns`,
`words_of`), so a row costs the same bytes there.

`encode` runs on the sampler's device inside the step, so it has no data-dependent shape and never
syncs with the host: every step's blocks are int32 [B, HEADER + ceil(V / 32)] whatever the supports,
the columns past each row's payload are -1 (ids found by a binary search of each row's running count,
the bitmask by packing, the layout per row by torch.where). The width is cut back on the host, after the copy, by
`payload_width` (narrowing.py): a column slice, no copy, so what crosses the process boundary is
each row's own payload plus the header. `decode_flat` reads any number of blocks of mixed widths in one
vectorised pass and refuses every damage that would change a row (BlockError, with the row).
Pure torch and numpy: no vLLM import (the patches in this package call it, the tests feed it tensors).
"""
from __future__ import annotations

import numpy as np
import torch

from mask_replay.errors import EngineOutputError
from mask_replay.sampler.adapters.vllm_support import SupportRows

BITMASK = -1
WHOLE = -2
HEADER = 2  # V and H
# rows of one encode chunk: its int32 running counts stay under this many elements (64 MiB) whatever B and V
CHUNK_ELEMENTS = 2**24


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def as_columns(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int32 blocks [B, C] as columns of an id tensor of `dtype`: int32 as they are; int64 two words a
    column, bit for bit (the first word in the low half, as a little-endian view reads them back), a -1 word
    added to an odd C. Static shapes: no host sync."""
    if dtype == torch.int32:
        return blocks
    if dtype != torch.int64:
        raise TypeError(f"support blocks ride on int32 or int64 token ids, not {dtype}")
    rows, words = blocks.shape
    paired = blocks.new_full((rows, words + words % 2), -1)  # dense, whatever the strides of `blocks`
    paired[:, :words] = blocks
    return paired.view(torch.int64)


def words_of(columns: np.ndarray) -> np.ndarray:
    """The int32 words of block columns (a numpy view where it can be): int32 columns are the words, int64
    columns hold two each (`as_columns`)."""
    if columns.dtype == np.int32:
        return columns
    if columns.dtype != np.int64:
        raise BlockError(0, f"block columns of dtype {columns.dtype}, not int32 or int64")
    if columns.strides[-1] != columns.itemsize:
        columns = np.ascontiguousarray(columns)
    return columns.view(np.int32)


def encode(support: torch.Tensor, sampled: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B, HEADER + ceil(V / 32)]: the blocks of `support` (bool [B, V], True where the sampler could
    draw), `greedy` rows (bool [B], or None) replaced by their `sampled` id alone. On an accelerator
    `encode_on_device` (static shapes, no host sync); a CPU tensor has no device to wait for, so it takes
    `encode_on_host` (numpy and one torch.nonzero: a few array passes instead of some twenty torch kernels,
    each of which contends for the engine's OpenMP threads). Both give the same tensor."""
    if support.device.type == "cpu":
        return encode_on_host(support, sampled, greedy)
    return encode_on_device(support, sampled, greedy)


def encode_on_device(support: torch.Tensor, sampled: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """`encode` with static shapes only: no host sync (tests/integrations/vllm_support/test_wire.py traces it
    under FakeTensorMode and on the meta device)."""
    rows, vocab = support.shape
    words = bitmask_words(vocab)
    support = support.to(torch.bool)
    if greedy is not None:
        alone = torch.zeros_like(support).scatter_(1, sampled.long().reshape(rows, 1), True)
        support = torch.where(greedy.to(torch.bool).reshape(rows, 1), alone, support)
    counts = support.sum(1)
    whole = counts == vocab
    as_bits = (counts > words) & ~whole
    out = torch.empty((rows, HEADER + words), dtype=torch.int32, device=support.device)
    out[:, 0] = vocab
    out[:, 1] = torch.where(whole, WHOLE, torch.where(as_bits, BITMASK, counts)).to(torch.int32)
    step = max(1, CHUNK_ELEMENTS // vocab)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        out[lo:hi, HEADER:] = _payload(support[lo:hi], as_bits[lo:hi], whole[lo:hi], words)
    return out


def encode_on_host(support: torch.Tensor, sampled: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """`encode` of CPU tensors in numpy: the ids of listed rows by torch.nonzero, bitmask rows by np.packbits."""
    bits = support.detach().to(torch.bool).numpy()
    rows, vocab = bits.shape
    words = bitmask_words(vocab)
    if greedy is not None:
        greedy_rows = np.flatnonzero(greedy.detach().to(torch.bool).numpy())
        if greedy_rows.size:
            bits = bits.copy()
            bits[greedy_rows] = False
            bits[greedy_rows, sampled.detach().numpy().astype(np.int64)[greedy_rows]] = True
    counts = bits.sum(1)
    whole = counts == vocab
    as_bits = (counts > words) & ~whole
    out = np.full((rows, HEADER + words), -1, dtype=np.int32)
    out[:, 0] = vocab
    out[:, 1] = np.where(whole, WHOLE, np.where(as_bits, BITMASK, counts))
    listed = np.flatnonzero(~as_bits & ~whole & (counts > 0))
    if listed.size:
        # torch's nonzero: 2.5-4x faster than numpy's on a [32, 49152] step (row-major: ids ascending in a row)
        found = torch.nonzero(torch.from_numpy(bits if listed.size == rows else bits[listed])).numpy()
        r, c = found[:, 0], found[:, 1]
        n = counts[listed]
        out[listed[r], HEADER + np.arange(r.size) - np.repeat(np.cumsum(n) - n, n)] = c
    packed = np.flatnonzero(as_bits)
    if packed.size:
        padded = np.zeros((packed.size, 32 * words), dtype=bool)
        padded[:, :vocab] = bits[packed]
        out[packed, HEADER:] = np.packbits(padded, axis=1, bitorder="little").view("<i4")
    return torch.from_numpy(out)


def _payload(support: torch.Tensor, as_bits: torch.Tensor, whole: torch.Tensor, words: int) -> torch.Tensor:
    """int32 [n, words]: the id list (then -1) of listed rows, the bitmask of bitmask rows, -1 for whole rows.
    The k-th listed id of a row is the first column where the row's running count of listed ids reaches k
    (a batched binary search of the cumulative sum): no scatter, no write collisions, static shapes (a
    listed row has at most `words` ids, so k = 1..words covers it; a k past the row's count finds V)."""
    n, vocab = support.shape
    listed = support & ~(as_bits | whole).reshape(n, 1)
    running = torch.cumsum(listed, 1, dtype=torch.int32)  # int32: the int64 default is 50x slower on the CPU
    k = torch.arange(1, words + 1, dtype=torch.int32, device=support.device).expand(n, words).contiguous()
    column = torch.searchsorted(running, k, out_int32=True)
    ids = torch.where(column < vocab, column, -1)
    return torch.where(as_bits.reshape(n, 1), _pack_bits(support, words), ids)


def _pack_bits(bits: torch.Tensor, words: int) -> torch.Tensor:
    """bool [R, V] -> int32 [R, words], bit j of word w = column 32 w + j: eight bits a byte, four bytes a
    little-endian word (the decoder reads '<i4'; CUDA devices and x86 hosts are little-endian)."""
    n, vocab = bits.shape
    padded = torch.zeros((n, words * 32), dtype=torch.uint8, device=bits.device)
    padded[:, :vocab] = bits
    weights = torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=bits.device),
                                       torch.arange(8, dtype=torch.uint8, device=bits.device))
    packed = (padded.view(n, words * 4, 8) * weights).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int32)


def payload_width(headers: np.ndarray) -> int:
    """The widest payload (columns past the header) that the blocks whose first two columns are
    `headers` (int32 [n, 2]) need: H for an id list, ceil(V / 32) for a bitmask, 0 for the whole
    vocabulary (0 for no rows; a damaged header asks for nothing, the decoder refuses it)."""
    if headers.shape[0] == 1:  # a request's single row (one token a step): plain ints are cheaper
        vocab, head = int(headers[0, 0]), int(headers[0, 1])
        return head if head >= 0 else bitmask_words(vocab) if head == BITMASK and vocab > 0 else 0
    if headers.shape[0] == 0:
        return 0
    vocab, head = headers[:, 0].astype(np.int64), headers[:, 1].astype(np.int64)
    need = np.where(head == BITMASK, np.maximum((vocab + 31) // 32, 0), np.maximum(head, 0))
    return int(need.max())


class BlockError(ValueError):
    """A block that does not decode: `row` is its index among the blocks decoded together."""

    def __init__(self, row: int, problem: str):
        super().__init__(problem)
        self.row, self.problem = row, problem


def decode_flat(values: np.ndarray, starts: np.ndarray, widths: np.ndarray) -> SupportRows:
    """The rows of the blocks values[starts[r] : starts[r] + widths[r]] (int32 values, int64 starts and
    widths), every block checked, in one vectorised pass. Raises BlockError for the first damaged row:
    narrower than its header, V < 1 or V unlike the first row's, a header that is no layout, an id list
    longer than its columns, ids outside [0, V) or not strictly ascending, a bitmask shorter than
    ceil(V / 32) words or with bits at ids >= V."""
    rows = starts.size
    if rows == 0:
        return SupportRows(np.zeros(0, np.int32), np.zeros(1, np.int64), 0)
    short = widths < HEADER
    if short.any():
        r = int(np.flatnonzero(short)[0])
        raise BlockError(r, f"its block has {int(widths[r])} columns, fewer than the {HEADER} of the header")
    vocabs, heads = values[starts].astype(np.int64), values[starts + 1].astype(np.int64)
    vocab = int(vocabs[0])
    if vocab < 1:
        raise BlockError(0, f"vocabulary width {vocab} in the block header")
    other = vocabs != vocab
    if other.any():
        r = int(np.flatnonzero(other)[0])
        raise BlockError(r, f"vocabulary width {int(vocabs[r])} in the block header, the request's first row "
                            f"had {vocab}")
    room = widths - HEADER
    words = bitmask_words(vocab)
    listed, bits, whole = heads >= 0, heads == BITMASK, heads == WHOLE
    bad = ~(listed | bits | whole) | (listed & (heads > room)) | (bits & (room < words))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        head = int(heads[r])
        what = (f"a bitmask of {int(room[r])} words, its header announces {words} (V = {vocab})" if head == BITMASK
                else f"header {head} for {int(room[r])} payload columns")
        raise BlockError(r, what)
    counts = np.where(listed, heads, 0)
    if bits.any():  # the bitmask rows' words, unpacked: [rows with a bitmask, words * 32] bits
        b_rows = np.flatnonzero(bits)
        words_at = starts[b_rows, None] + HEADER + np.arange(words)
        unpacked = np.unpackbits(values[words_at].astype("<i4").view(np.uint8), axis=1, bitorder="little")
        beyond = unpacked[:, vocab:].any(1)
        if beyond.any():
            r = int(b_rows[np.flatnonzero(beyond)[0]])
            raise BlockError(r, f"bitmask bits set at ids >= its vocabulary width {vocab}")
        hit_row, hit_id = np.nonzero(unpacked[:, :vocab])  # row-major: ids ascending within each row
        counts[b_rows] = np.bincount(hit_row, minlength=b_rows.size)
    counts[whole] = vocab
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids = np.empty(int(offsets[-1]), dtype=np.int32)
    if listed.any():
        l_rows = np.flatnonzero(listed)
        n = counts[l_rows]
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        got = values[np.repeat(starts[l_rows] + HEADER, n) + within].astype(np.int64)
        row_of = np.repeat(l_rows, n)
        outside = (got < 0) | (got >= vocab)
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            raise BlockError(int(row_of[i]), f"support id {int(got[i])} is outside [0, {vocab})")
        falling = (np.diff(got) <= 0) & (row_of[1:] == row_of[:-1])
        if falling.any():
            r = int(row_of[int(np.flatnonzero(falling)[0]) + 1])
            raise BlockError(r, "support ids are not strictly ascending")
        ids[np.repeat(offsets[l_rows], n) + within] = got
    if bits.any():
        n = counts[b_rows]
        ids[offsets[b_rows][hit_row] + np.arange(hit_row.size) - np.repeat(np.cumsum(n) - n, n)] = hit_id
    if whole.any():
        w_rows = np.flatnonzero(whole)
        ids[(offsets[w_rows, None] + np.arange(vocab)).ravel()] = np.tile(np.arange(vocab, dtype=np.int32),
                                                                          w_rows.size)
    return SupportRows(ids, offsets, vocab)


def decode(blocks: np.ndarray) -> list[np.ndarray]:
    """The support ids (int32, ascending) of each block row of `blocks` (block columns [n, columns], int32,
    or int64 holding two words each); a damaged block raises EngineOutputError naming its row."""
    try:
        blocks = np.ascontiguousarray(words_of(np.asarray(blocks)))
        n, width = blocks.shape
        rows = decode_flat(blocks.ravel(), np.arange(n, dtype=np.int64) * width, np.full(n, width, np.int64))
    except BlockError as e:
        raise EngineOutputError(f"support block {e.row}: {e.problem}") from None
    return [rows.token_ids[a:b] for a, b in zip(rows.offsets[:-1], rows.offsets[1:])]


def join(rows: list[np.ndarray], vocab_size: int) -> SupportRows:
    """Per-token id arrays as one SupportRows."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    if rows:
        np.cumsum([r.size for r in rows], out=offsets[1:])
    ids = np.concatenate(rows).astype(np.int32, copy=False) if rows else np.zeros(0, dtype=np.int32)
    return SupportRows(ids, offsets, vocab_size)
