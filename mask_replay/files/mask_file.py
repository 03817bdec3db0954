"""Mask files with bounded memory: MaskFile reads one in row chunks (what `score` uses, so its memory
does not grow with the supports); MaskSink writes one chunk by chunk (what `capture` uses), MemorySink
keeps the chunks for a torchrun rank to send.

Reading:

SamplingMask.load reads every tensor; a mask of flat rows is as large as an fp32 dump (GBs). Here
nothing is read whole: the per-row keys (offsets, sampled, logprobs, ...: RowKey) and the
support ids of rows [a, b) are read with pread when those rows are scored, the ids checked then
(SamplingMask.validate on the chunk: ids in range and ascending, sampled in range). The checks
that need the whole file (offsets start at 0, never decrease, end at the number of ids; every
per-row value possible) are made once at open, in one pass over blocks of CHECK_BLOCK rows, so
a bad late row is refused before anything is written. Before any of
them is read, the header alone is checked (check_mask_header: a key whose declared shape is not
one value per row is refused before its bytes are allocated; check_unique_keys: a header naming a
key twice), the same checks for SamplingMask.load (read_mask_tensors) and `inspect`.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import torch

from mask_replay.csr import check_offsets, check_row_values
from mask_replay.errors import DumpError, MaskFormatError
from mask_replay.files.dumps import Dump, _dtname
from mask_replay.files.safetensors_stream import MAX_HEADER, Header, StreamWriter, read_all, save
from mask_replay.mask import _ROW_EXTRAS, ENTRY_KEY, SEMANTICS, SamplingMask, adapter
from mask_replay.version import __version__

FORMAT_VERSION = "1"


def file_metadata(metadata: dict) -> dict:
    """The safetensors string map of a mask file: structured values as JSON, keys sorted (also
    inside the JSON), so identical runs write identical bytes."""
    meta = {str(k): v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()}
    meta.setdefault("semantics", SEMANTICS)  # an engine profile names itself there (mask_replay.sampler.profiles)
    meta.update({"format_version": FORMAT_VERSION, "mask_replay_version": __version__})
    return dict(sorted(meta.items()))


# What each documented key of a mask file must hold (docs/formats.md); a file that breaks it is
# refused at load, naming the key, before any value is used as an index or a step number.
_FILE_KINDS = {"sampled": "integer", "step": "integer", "sequence": "integer", "position": "integer",
               "logprob_mismatch": "integer", "logprobs": "float", ENTRY_KEY: "float",
               "kept_mass": "float", "capture_logprobs": "float", "temperature": "float", "outside_support": "bool"}


def check_file_dtypes(tensors: dict, source: str) -> None:
    """`tensors`: key -> tensor, or key -> dtype (a file's header, checked before anything is read)."""
    for key, kind in _FILE_KINDS.items():
        t = tensors.get(key)
        if t is None:
            continue
        dt = t if isinstance(t, torch.dtype) else t.dtype
        ok = {"integer": not dt.is_floating_point and dt != torch.bool,
              "float": dt.is_floating_point, "bool": dt == torch.bool}[kind]
        if not ok:
            raise MaskFormatError(f"{source}: key '{key}': must be {'an' if kind == 'integer' else 'a'} {kind} "
                                  f"tensor, got {str(dt).replace('torch.', '')}")


def check_format_version(metadata: dict, path: str) -> None:
    """A mask file written by another format version is refused by name; one without the key (a file
    written by another tool) is read as this version."""
    version = metadata.get("format_version")
    if version is not None and version != FORMAT_VERSION:
        raise MaskFormatError(f"format_version {version!r}: this mask_replay ({__version__}) reads format_version "
                              f"{FORMAT_VERSION!r} (read it with the version that wrote it, or convert it)", file=path)


@adapter("save")
def save_mask(mask: SamplingMask, path) -> None:
    """SamplingMask.save: a safetensors file written atomically (temp file in the same folder, then
    rename), in a stable layout with sorted metadata: the same mask always gives the same bytes."""
    save(path, mask.tensors(), file_metadata(mask.metadata))


@adapter("load")
def load_mask(path, device="cpu", *, validate: bool = True) -> SamplingMask:
    """SamplingMask.load: the mask file at `path`, read whole (read_mask_tensors' checks first)."""
    tensors, meta = read_mask_tensors(path, check=validate)
    for key in ("token_ids", "offsets"):
        if key not in tensors:
            raise MaskFormatError(f"missing key '{key}' (is this a mask file?)", file=str(path))
    check_file_dtypes(tensors, str(path))
    named = {k: tensors.pop(k) for k in _ROW_EXTRAS + (ENTRY_KEY,) if k in tensors}
    mask = SamplingMask(tensors.pop("token_ids"), tensors.pop("offsets"), extras=tensors, metadata=meta, **named)
    if validate:
        mask.validate(source=str(path))
    return mask.to(device) if str(device) != "cpu" else mask


# rows per block of the checks at open (transient memory a few MB, whatever the rows)
CHECK_BLOCK = 1 << 20


class RowKey:
    """One per-row key of an open mask file (offsets included), read when sliced: key[a:b] is rows
    [a, b) read with pread, so holding one costs nothing; shape and dtype come from the header.
    whole() reads every row, for a caller that truly needs them all."""

    def __init__(self, dump: Dump, key: str):
        self._dump, self.key = dump, key
        self.shape = tuple(dump.shape(key))
        self.dtype = dump.dtype(key)

    def numel(self) -> int:
        return self.shape[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice):
            a, b, step = index.indices(self.shape[0])
            if step != 1:
                raise IndexError(f"{self.key}: only contiguous row ranges are read, not step {step}")
            return self._dump.get(self.key, a, max(a, b))
        i = int(index)
        if i < 0:
            i += self.shape[0]
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"{self.key}: row {index} out of range for {self.shape[0]} rows")
        return self._dump.get(self.key, i, i + 1)[0]

    def blocks(self, block: Optional[int] = None, overlap: int = 0):
        """(first row a, rows [a, a + block + overlap)) of the key, block by block (CHECK_BLOCK rows
        when None, looked up at the call so that tests can make blocks small)."""
        block = block or CHECK_BLOCK
        n = self.shape[0]
        for a in range(0, max(n - overlap, 1), block):
            yield a, self[a: a + block + overlap]

    def whole(self) -> torch.Tensor:
        return self._dump.get(self.key)

    def __repr__(self) -> str:
        return f"RowKey({self.key!r}, {_dtname(self.dtype)} {list(self.shape)})"


class MaskFile:
    """A mask file open for reading in row chunks: offsets, sampled, logprobs, kept_mass and the
    extras are RowKeys (read per slice), so what it holds does not grow with the rows."""

    def __init__(self, path: str):
        self.path = path
        self._dump = Dump(path)
        try:
            self._open()
        except BaseException:
            self._dump.close()
            raise

    def _open(self):
        d, path = self._dump, self.path
        check_format_version(d.metadata, path)  # before anything else is read
        check_unique_keys(path)
        check_mask_header(path, header_entries(d))  # before anything is read: shapes bound what is
        self.nnz = d.shape("token_ids")[0]
        # entry_logprobs is per entry ([nnz], read with its rows' ids); every other key is per row
        # (check_mask_header: each of shape [N])
        self.has_entry_logprobs = ENTRY_KEY in d
        per_row = {k: RowKey(d, k) for k in d.keys() if k not in ("token_ids", ENTRY_KEY)}
        self.offsets = per_row.pop("offsets")
        self.num_rows = self.offsets.numel() - 1
        _check_offsets_blocks(self.offsets, self.nnz, path)
        named = {k: per_row.pop(k) for k in _ROW_EXTRAS if k in per_row}
        self.sampled = named.get("sampled")
        self.logprobs = named.get("logprobs")
        self.kept_mass = named.get("kept_mass")
        self.extras = per_row
        # key by key, block by block: the first bad row of the first bad key, as on the whole keys
        for name, key in (("logprobs", self.logprobs), ("kept_mass", self.kept_mass),
                          ("capture_logprobs", per_row.get("capture_logprobs"))):
            if key is not None:
                for a, block in key.blocks():
                    check_row_values({name: block}, source=path, row_offset=a)
        self.metadata = dict(self._dump.metadata)

    def rows(self, a: int, b: int, vocab_size: int) -> SamplingMask:
        """Rows [a, b) with their support ids (and entry log-probs, when the file has them), checked
        against the vocabulary."""
        o = self.offsets[a: b + 1]
        lo, hi = int(o[0]), int(o[-1])
        # a view of the file map, released when the next chunk is read (see Dump.get)
        sub = SamplingMask(self._dump.get("token_ids", lo, hi, stream=True), o - lo,
                           None if self.sampled is None else self.sampled[a:b].to(torch.int64),
                           entry_logprobs=self._dump.get(ENTRY_KEY, lo, hi).to(torch.float32)
                           if self.has_entry_logprobs else None)
        try:
            sub.validate(vocab_size=vocab_size, source=self.path)
        except MaskFormatError as exc:
            raise exc.at(row_offset=a) from None
        return sub

    def close(self):
        self._dump.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_offsets_blocks(offsets: RowKey, nnz: int, path: str) -> None:
    """check_offsets (start at 0, never decrease, end at nnz) block by block, each block overlapping
    the next by one value; a later block is checked with a 0 put before it (its first value was
    checked >= 0 by the block before), so check_offsets' words and rows hold, shifted back by one."""
    n = offsets.numel()
    zero = torch.zeros(1, dtype=torch.int64)
    for a, block in offsets.blocks(overlap=1):
        last = a + block.numel() >= n
        end = nnz if last else int(block[-1])
        try:
            check_offsets(block if a == 0 else torch.cat([zero, block]), end, source=path)
        except MaskFormatError as exc:
            raise exc.at(row_offset=a if a == 0 else a - 1) from None


def header_entries(d: Dump) -> dict:
    """key -> (dtype, shape) of an open file, from its header (nothing read)."""
    return {k: (d.dtype(k), tuple(d.shape(k))) for k in d.keys()}


def check_mask_header(path: str, entries: dict) -> None:
    """What a mask file's header alone must hold, checked before any tensor is read (entries: key ->
    (dtype, shape)): token_ids 1-D int32, offsets 1-D int64 of N + 1 >= 1 entries, entry_logprobs one
    float per id, every other key one value per row ([N]), each documented key of its kind. So a
    key whose declared shape lies (GBs for a 24-row file) is refused before its bytes are allocated."""
    for key in ("token_ids", "offsets"):
        if key not in entries:
            raise MaskFormatError(f"missing key '{key}' (is this a mask file?)", file=path)
    dt, shape = entries["token_ids"]
    if dt != torch.int32 or len(shape) != 1:
        raise MaskFormatError(f"must be a 1-D int32 tensor, got {_dtname(dt)} {list(shape)}", file=path,
                              key="token_ids")
    nnz = shape[0]
    dt, shape = entries["offsets"]
    if dt != torch.int64 or len(shape) != 1 or shape[0] < 1:
        raise MaskFormatError(f"must be a 1-D int64 tensor of N+1 >= 1 entries, got {_dtname(dt)} {list(shape)}",
                              file=path, key="offsets")
    n = shape[0] - 1
    check_file_dtypes({k: dt for k, (dt, _) in entries.items()}, path)
    for key, (dt, shape) in entries.items():
        if key == ENTRY_KEY and tuple(shape) != (nnz,):
            raise MaskFormatError(f"must be a 1-D float tensor of {nnz} entries (one per support id), got "
                                  f"{_dtname(dt)} {list(shape)}", file=path, key=key)
        if key not in ("token_ids", "offsets", ENTRY_KEY) and tuple(shape) != (n,):
            raise MaskFormatError(f"{key} must have shape [{n}], got {tuple(shape)}", file=path)


def check_unique_keys(path: str) -> None:
    """DumpError when the JSON header of the safetensors file at `path` names a key twice in one
    object (two tensors, two metadata entries, two fields of an entry): JSON leaves a duplicate's
    meaning open and readers differ (Python's json and the reference reader keep the last tensor
    entry, the reference reader refuses a second __metadata__), so one file could be read as two
    masks. A file whose header cannot be read at all is left to the reader, which says why."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                return
            text = f.read(n)
    except OSError:
        return
    twice = []

    def unique(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen and k not in twice:
                twice.append(k)
            seen.add(k)
        return dict(pairs)

    try:
        json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError):
        return
    if twice:
        raise DumpError(f"the safetensors header names '{twice[0]}' twice (a JSON duplicate key: readers "
                        "disagree on which one counts)", file=path)


def read_mask_tensors(path, *, check: bool = True):
    """(tensors, metadata) of the mask file at `path`, read whole (SamplingMask.load). With `check`,
    the header is checked first (check_unique_keys, check_mask_header): a key whose shape lies is
    refused before it is read."""
    path = os.fspath(path)
    if check:
        if os.path.isdir(path):
            raise DumpError("is a folder, expected a mask file", file=path)
        if os.path.exists(path):  # a missing file: read_all says so
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise DumpError(f"cannot be opened ({exc.strerror})", file=path) from None
            try:
                header = Header(path, fd)
            finally:
                os.close(fd)
            check_format_version(header.metadata, path)
            check_unique_keys(path)
            check_mask_header(path, {k: (v[0], v[1]) for k, v in header.tensors.items()})
    return read_all(path)


# Room kept in a streamed mask file's header for the log-prob mismatch report, which is known only
# at the end (a few counts and a cause name: well under this).
MISMATCH_REPORT_ROOM = 1024


class MaskSink:
    """A mask file written chunk by chunk (layout in safetensors_stream.StreamWriter)."""

    def __init__(self, f, rows: int, vocab: int, carried, outside: str, metadata: dict, compare: bool = False,
                 entries: bool = False):
        head = {"offsets": (torch.int64, (rows + 1,))}
        for k in ("sampled",) + tuple(carried):
            head[k] = (torch.int64, (rows,))
        for k in ("logprobs", "kept_mass", "capture_logprobs", "temperature"):
            head[k] = (torch.float32, (rows,))
        # one-byte tensors go after token_ids (alignment): outside_support only when some row was
        # flagged, logprob_mismatch when some dump had rollout_logprobs
        tail = {"outside_support": (torch.bool, (rows,))} if outside == "flag" else {}
        if compare:
            tail["logprob_mismatch"] = (torch.int8, (rows,))
        self.outside = outside
        self.nnz = 0
        self.w = StreamWriter(f, head, growing=("token_ids", torch.int32, rows * vocab), tail_room=tail,
                              metadata=file_metadata(metadata),
                              metadata_room=MISMATCH_REPORT_ROOM if compare else 0,
                              spooled=(ENTRY_KEY, torch.float32, rows * vocab) if entries else None)
        self.w.write_rows("offsets", 0, torch.zeros(1, dtype=torch.int64))

    def write(self, row0: int, m, extras: dict) -> None:
        """Rows [row0, row0 + m.num_rows): the chunk's mask and its per-row keys."""
        self.w.write_rows("offsets", row0 + 1, m.offsets[1:].cpu() + self.nnz)
        self.w.append(m.token_ids)
        if self.w.spooled is not None:
            self.w.append_spooled(m.entry_logprobs)
        self.nnz += m.nnz
        self.w.write_rows("sampled", row0, m.sampled)
        self.w.write_rows("kept_mass", row0, m.kept_mass)
        for k, v in extras.items():
            if k not in ("outside_support", "logprob_mismatch"):
                self.w.write_rows(k, row0, v)

    def finish(self, flagged: torch.Tensor, codes: Optional[torch.Tensor], mismatch: Optional[dict]):
        tail = {"outside_support": flagged} if self.outside == "flag" and bool(flagged.any()) else {}
        if codes is not None:
            tail["logprob_mismatch"] = codes
        self.w.finish(tail, metadata={"logprob_mismatch": _json(mismatch)} if mismatch is not None else None)
        return None  # the mask is on disk, never whole in memory


class MemorySink:
    """One rank's share under torchrun (mask_replay.distributed): the chunks' masks kept in memory
    and concatenated, for rank 0 to gather and write."""

    def __init__(self, carried, outside: str, metadata: dict, compare: bool = False, entries: bool = False):
        self.carried, self.outside, self.metadata, self.parts = carried, outside, metadata, []
        self.compare, self.entries = compare, entries

    def write(self, row0: int, m, extras: dict) -> None:
        self.parts.append((m, extras))

    def finish(self, flagged, codes, mismatch):
        mask = _concat(self.parts, self.carried, self.outside, self.compare)
        if self.entries and mask.entry_logprobs is None:  # no rows: MaskSink writes the (empty) key too
            mask.entry_logprobs = torch.zeros(0)
        mask.metadata = dict(self.metadata)
        if mismatch is not None:
            mask.metadata["logprob_mismatch"] = mismatch
        return mask


def _json(value) -> str:
    return json.dumps(value, sort_keys=True)


def _concat(parts, carried, outside, compare=False):
    masks = []
    for m, ex in parts:
        masks.append(SamplingMask(m.token_ids, m.offsets, m.sampled, ex["logprobs"], m.kept_mass,
                                  {k: v for k, v in ex.items() if k != "logprobs"},
                                  entry_logprobs=m.entry_logprobs))
    mask = SamplingMask.concat(masks) if masks else SamplingMask.concat([])
    if not masks:  # no rows at all: an empty mask still carries empty per-row keys
        mask.sampled = torch.zeros(0, dtype=torch.int64)
        mask.logprobs = torch.zeros(0)
        mask.kept_mass = torch.zeros(0)
        mask.extras = {"temperature": torch.zeros(0), "capture_logprobs": torch.zeros(0)}
        mask.extras.update({k: torch.zeros(0, dtype=torch.int64) for k in carried})
        if compare:  # MaskSink writes this column whenever some dump has rollout_logprobs, rows or not
            mask.extras["logprob_mismatch"] = torch.zeros(0, dtype=torch.int8)
    if outside == "error" or not bool(mask.extras.get("outside_support", torch.zeros(0, dtype=torch.bool)).any()):
        mask.extras.pop("outside_support", None)  # only written when some row was flagged
    return mask
