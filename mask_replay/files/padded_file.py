"""Padded mask files: a safetensors file with `ids` [N, W] int32 (-1 padding) and `counts` [N]
int32, plus the mask's per-row keys (sampled, logprobs, kept_mass, step, sequence, ...) as they are and,
when the mask has them, `entry_logprobs` [N, W] float32 padded with -inf (docs/formats.md, "Padded mask
file").

`convert` goes both ways chunk by chunk (padded_to_mask_file, mask_file_to_padded): rows are read,
checked and written a chunk at a time, into a file laid out as save() lays out the whole mask (the
same bytes), so memory stays one chunk of rows whatever the file's size. The checks are those of
load_padded + mask_from_padded (and MaskFile's for a mask file), with errors naming the file's row."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Callable, Optional

import torch

from mask_replay.errors import DumpError, InputError
from mask_replay.files.dumps import PER_ROW_BYTES
from mask_replay.files.mask_file import MaskFile, RowKey, file_metadata
from mask_replay.files.safe_output import atomic_file, is_stream
from mask_replay.files.safetensors_stream import Header, fixed_writer, pread_rows, read_all, save
from mask_replay.mask import ENTRY_KEY, SamplingMask
from mask_replay.sampler.adapters.padded import (
    check_counts,
    check_layout,
    mask_from_padded,
    padded_width,
    to_padded,
    wider_row,
)

# Names a padded file's other tensors cannot have: the mask file's CSR keys, and mask_from_padded's own
# arguments (a tensor named `source` or `vocab_size` would be taken as one).
RESERVED_KEYS = ("token_ids", "offsets", "ids", "counts", "strict_padding", "vocab_size", "source", "metadata")


def save_padded(mask: SamplingMask, path, width: Optional[int] = None) -> None:
    """Atomic write; a row wider than `width` is a ValueError naming the row."""
    ids, counts, *entries = to_padded(mask, width)
    tensors = {k: v for k, v in mask.tensors().items() if k not in ("token_ids", "offsets")}
    tensors.update({"ids": ids.cpu().contiguous(), "counts": counts.cpu().contiguous()})
    if entries:
        tensors["entry_logprobs"] = entries[0].cpu().contiguous()
    meta = file_metadata(mask.metadata)
    meta["layout"] = "padded"
    save(path, tensors, meta)


def load_padded(path) -> SamplingMask:
    path = os.fspath(path)
    tensors, meta = read_all(path)
    _check_keys(path, tensors)
    ids, counts = tensors.pop("ids"), tensors.pop("counts")
    meta.pop("layout", None)
    mask = mask_from_padded(ids, counts, source=path, metadata=meta, **tensors)
    return mask.validate(source=path)


def _check_keys(path: str, keys) -> None:
    for key in ("ids", "counts"):
        if key not in keys:
            raise DumpError(f"{path}: missing key '{key}' (is this a padded mask file?)")
    for key in sorted(set(keys) - {"ids", "counts"}):
        if key in RESERVED_KEYS:  # would pass as an argument, or write a mask whose CSR keys clash
            raise DumpError(f"key '{key}' is not a per-row tensor a padded mask file may hold (reserved name)",
                            file=path)


# ---- convert, chunk by chunk ----------------------------------------------------------------------
# Working memory of a chunk, and what one slot of its [rows, W] layout takes in it: the slot's id and
# entry log-prob as read or written, mask_from_padded's int64 copy, sort key, permutation and
# masks (a dozen values of up to 8 bytes, rounded up). 64 MiB keeps a chunk small beside a file of
# hundreds of MB and large enough that the per-chunk overhead does not show.
CHUNK_BYTES = 64 << 20
SLOT_BYTES = 96


Each = Optional[Callable[[SamplingMask], None]]  # called with every chunk's mask


def chunk_rows_for(width: int) -> int:
    """Rows per chunk for a padded layout `width` slots wide."""
    return max(1, CHUNK_BYTES // (width * SLOT_BYTES + PER_ROW_BYTES))


def _starts(n: int, step: int) -> range:
    return range(0, n, step) if n else range(1)  # no rows: one empty chunk, so that the file is written


def padded_to_mask_file(path, output, *, vocab_size: Optional[int] = None, chunk_rows: Optional[int] = None,
                        each: Each = None) -> None:
    """The mask file of padded file `path`, written to `output` atomically chunk by chunk: the bytes of
    load_padded(path).save(output), with load_padded's checks (and ids and sampled tokens in
    [0, vocab_size) when given). `each` is called with every chunk's mask."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DumpError(f"{path}: is a folder, expected a padded mask file")
    fd = os.open(path, os.O_RDONLY)
    try:
        _padded_to_mask(path, fd, Header(path, fd), output, vocab_size, chunk_rows, each)
    finally:
        os.close(fd)


def _padded_to_mask(path, fd, header, output, vocab_size, chunk_rows, each):
    specs = {k: (dtype, shape) for k, (dtype, shape, _, _) in header.tensors.items()}
    _check_keys(path, specs)
    meta = dict(header.metadata)
    meta.pop("layout", None)
    # dtypes and shapes first, on meta tensors (no data): what mask_from_padded checks of the whole
    layout = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in specs.items()}
    ids, counts, entries = layout.pop("ids"), layout.pop("counts"), layout.pop(ENTRY_KEY, None)
    n, w = check_layout(ids, counts, entries, layout, path)
    step = chunk_rows or chunk_rows_for(w)

    def read(key, a, b):
        try:
            return pread_rows(fd, header, key, a, b)
        except OSError as exc:  # the file changed under us (Header checked its size)
            raise DumpError(f"{path}: key '{key}': rows {a}..{b - 1} cannot be read ({exc})") from exc

    # pass 1, counts only: each in [0, W] (checked before any id, as mask_from_padded does), and
    # their sum, the length of token_ids, which the file's header gives before the data
    nnz = 0
    for a in _starts(n, step):
        c = read("counts", a, a + step)
        try:
            check_counts(c, w, path)
        except InputError as exc:
            raise exc.at(row_offset=a) from None
        nnz += int(c.sum())
    out = {"token_ids": (torch.int32, (nnz,)), "offsets": (torch.int64, (n + 1,))}
    if entries is not None:
        out[ENTRY_KEY] = (torch.float32, (nnz,))
    out.update({k: (v.dtype, (n,)) for k, v in layout.items()})
    with atomic_file(output) as f:
        writer = fixed_writer(f, out, file_metadata(meta))
        writer.write_rows("offsets", 0, torch.zeros(1, dtype=torch.int64))
        done = 0  # ids written so far
        for a in _starts(n, step):
            b = min(n, a + step)
            rows = {k: read(k, a, b) for k in layout}
            try:
                m = mask_from_padded(read("ids", a, b), read("counts", a, b), source=path, metadata=meta,
                                     entry_logprobs=None if entries is None else read(ENTRY_KEY, a, b), **rows)
                m.validate(vocab_size=vocab_size, source=path)  # load_padded's, and convert's vocabulary
            except InputError as exc:
                raise exc.at(row_offset=a) from None
            _write_chunk(writer, m, a, done)
            done += m.nnz
            if each is not None:
                each(m)
        writer.finish()


def _write_chunk(writer, m: SamplingMask, row0: int, done: int) -> None:
    """Rows row0.. of mask `m` into a mask file's writer; `done` ids come before them."""
    for k, v in m.tensors().items():
        if k in ("token_ids", ENTRY_KEY):
            writer.write_rows(k, done, v)
        elif k == "offsets":
            writer.write_rows(k, row0 + 1, v[1:] + done)
        elif k in writer.tail_room:
            writer.write_tail_rows(k, row0, v)
        else:
            writer.write_rows(k, row0, v)


def _width(offsets: RowKey, width: Optional[int]) -> int:
    """to_padded's width checks, from a mask file's offsets read block by block (one block of row
    lengths alive at a time): a given width is checked first, then the first row wider than it is
    named; without one, the widest row is the width."""
    if width is not None:
        width = padded_width(0, width)
    widest = 0
    for a, o in offsets.blocks(overlap=1):
        lengths = o[1:] - o[:-1]
        if not lengths.numel():
            continue
        if width is None:
            widest = max(widest, int(lengths.max()))
            continue
        wide = torch.nonzero(lengths > width)
        if wide.numel():
            r = int(wide[0])
            raise wider_row(a + r, int(lengths[r]), width)
    return padded_width(widest, None) if width is None else width


def _check_room(output, specs: dict, width: int) -> None:
    """Every row of a padded file is as wide as the widest (or --width): it can be far larger than
    its mask file. One its file system cannot hold is refused before a byte is written, rather than
    filling the disk (the whole-mask path failed at the allocation instead)."""
    nbytes = sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for dtype, shape in specs.values())
    folder = tempfile.gettempdir() if is_stream(output) else os.path.dirname(os.path.realpath(os.fspath(output)))
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise DumpError(f"the padded file (width {width}) would take {nbytes:,} bytes, more than the {free:,} free "
                        f"in {folder}", file=os.fspath(output))


def mask_file_to_padded(path, output, width: Optional[int] = None, *, vocab_size: Optional[int] = None,
                        chunk_rows: Optional[int] = None, each: Each = None) -> None:
    """The padded file of mask file `path`, written to `output` atomically chunk by chunk: the bytes
    of save_padded(SamplingMask.load(path), output, width). The mask file is read with MaskFile
    (its checks, ids and sampled tokens in [0, vocab_size) when given); a row wider than `width` is a
    ValueError naming the row, before anything is written. `each` is called with every chunk's mask."""
    with MaskFile(os.fspath(path)) as mf:
        n = mf.num_rows
        width = _width(mf.offsets, width)
        named = {k: getattr(mf, k) for k in ("sampled", "logprobs", "kept_mass") if getattr(mf, k) is not None}
        per_row = {**named, **mf.extras}  # RowKeys: each chunk reads its rows
        out = {k: (v.dtype, (n,)) for k, v in per_row.items()}
        out.update({"ids": (torch.int32, (n, width)), "counts": (torch.int32, (n,))})
        if mf.has_entry_logprobs:
            out[ENTRY_KEY] = (torch.float32, (n, width))
        meta = file_metadata(mf.metadata)
        meta["layout"] = "padded"
        _check_room(output, out, width)
        step = chunk_rows or chunk_rows_for(width)
        with atomic_file(output) as f:
            writer = fixed_writer(f, out, meta)
            for a in _starts(n, step):
                b = min(n, a + step)
                sub = mf.rows(a, b, vocab_size)
                # its ids are a view of MaskFile's map, unmapped at close: `each` may keep the chunk
                chunk = SamplingMask(sub.token_ids.clone(), sub.offsets, entry_logprobs=sub.entry_logprobs,
                                     extras={k: v[a:b] for k, v in mf.extras.items()},
                                     **{k: v[a:b] for k, v in named.items()})
                ids, counts, *lp = to_padded(chunk, width)
                writer.write_rows("ids", a, ids)
                writer.write_rows("counts", a, counts)
                if lp:
                    writer.write_rows(ENTRY_KEY, a, lp[0])
                for k, v in chunk.tensors().items():
                    if k in per_row:
                        (writer.write_tail_rows if k in writer.tail_room else writer.write_rows)(k, a, v)
                if each is not None:
                    each(chunk)
            writer.finish()
