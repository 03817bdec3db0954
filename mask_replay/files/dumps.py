"""Reading rollout and training dumps: lazy row slices, and validation whose errors name file/key/row.

A dump is a flat mapping key -> tensor in one of three containers:
  .safetensors  chunk loops (get(..., stream=True)) get views of a private map of the file, and each
                chunk's pages are released (MADV_DONTNEED) when the next is read, so a dump larger
                than RAM streams in one chunk of resident memory (a plain map keeps every page
                read); other reads are copied out with pread;
  .pt           torch.load(weights_only=True, mmap=True): a dict of tensors, pages read on demand;
  .npz          only the members' .npy headers are read at open; rows are read from a seekable
                member stream (a compressed member is inflated in order, never whole).
The formats are described in docs/formats.md.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import tempfile
import zipfile
from typing import Optional

import numpy as np
import torch

from mask_replay.errors import DumpError
from mask_replay.files.safetensors_stream import Header, checked_shape, pread_rows
from mask_replay.params import FLOAT_DTYPES, INT_DTYPES

# Optional per-row keys of a rollout dump and what they must hold.
# Target bytes per chunk of rows when the caller gives no row count: the chunk's logits plus whatever
# each row's entries need beside them (capture: the widest mask they can give, 4 bytes of int32 id
# per token), so that flat rows at top-p .95 stay within budget too (measured: 0.66 GB peak anonymous
# memory for 6 and 12 GB dumps, benchmarks/bench_memory.py).
DEFAULT_CHUNK_BYTES = 256 << 20
# What a row of a chunk costs besides its `vocab` entries, whatever V: the per-row buffers of capture
# and score (sampled, offsets, the four sampling parameters expanded per row, replay's log-prob, lse
# and status, kept mass, the mask's per-row extras and their conversions for the file, the profiles'
# per-row switches), about 40 values of up to 8 bytes, rounded up. Without it a small vocabulary
# made chunks of millions of rows whose per-row buffers, not their logits, filled memory (V = 2: a
# 128 MB dump peaked at 1.1 GB).
PER_ROW_BYTES = 384


def default_chunk_rows(vocab: int, bytes_per_entry: int) -> int:
    """Rows per chunk: DEFAULT_CHUNK_BYTES over the bytes a row takes, its `vocab` entries of
    `bytes_per_entry` and its per-row buffers (PER_ROW_BYTES) together."""
    return max(1, DEFAULT_CHUNK_BYTES // (max(0, vocab) * max(0, bytes_per_entry) + PER_ROW_BYTES))


PARAM_KEYS = ("temperature", "top_k", "top_p", "min_p")
_PER_ROW_KINDS = {
    "temperature": "float", "top_k": "int", "top_p": "float", "min_p": "float",
    "rollout_logprobs": "float", "step": "int", "sequence": "int",
    # the engine batch (rows sampled in one engine step) of each row: batch-wide choices of the engine
    # profiles are made per batch; without it a dump is one batch (docs/formats.md)
    "batch": "int",
}
# Keys that may be 0-dim (one value for all rows); the others must be [N].
_SCALAR_OK = set(PARAM_KEYS)

class Dump:
    """One dump file opened for lazy row access. Use as a context manager or call close().

    inflate_limit: refuse (at open) a compressed .npz member that declares more bytes than this
    (a zip bomb inflates a few MB into GBs); None reads any size.
    """

    def __init__(self, path, inflate_limit: Optional[int] = None):
        self.path = os.fspath(path)
        self.name = self.path
        if not os.path.exists(self.path):
            raise DumpError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise DumpError(f"{self.path}: is a folder, expected a dump file")
        ext = os.path.splitext(self.path)[1].lower()
        self._fd = None  # safetensors: read with pread, never mapped
        self._header = None
        self._zip = None  # .npz: members read lazily, row ranges through a seekable member stream
        self._npy = {}  # key -> (ZipInfo, numpy dtype, fortran order, offset of the data in the member)
        self._open_members = {}
        self._row_major = {}  # .npz Fortran-ordered member -> (temp file, its C-ordered np.memmap)
        self._streamable = False  # safetensors with data: get(..., stream=True) maps chunks
        self._mapped = {}  # key -> the private map of the last chunk handed out
        self._tensors = None  # .pt: dict of tensors
        self.metadata: dict = {}
        try:
            if ext == ".pt" or ext == ".pth":
                self._open_pt()
            elif ext == ".npz":
                self._open_npz(inflate_limit)
            else:  # .safetensors, and any other name: safetensors is the primary format
                self._open_safetensors()
        except DumpError:
            self.close()
            raise
        except Exception as exc:  # each backend has its own error types for corrupt files
            self.close()
            raise DumpError(f"{self.path}: not a readable {ext or 'safetensors'} dump ({_first_line(exc)})") from exc

    # ---- backends ----------------------------------------------------------------------------
    def _open_safetensors(self):
        self._fd = os.open(self.path, os.O_RDONLY)
        self._header = Header(self.path, self._fd)
        self._streamable = os.fstat(self._fd).st_size > 0
        self.metadata = dict(self._header.metadata)
        self._shapes = {k: v[1] for k, v in self._header.tensors.items()}
        self._dtypes = {k: v[0] for k, v in self._header.tensors.items()}

    def _open_pt(self):
        obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise DumpError(f"{self.path}: a .pt dump must hold a dict of tensors, got {type(obj).__name__}")
        for k, v in obj.items():  # what torch.load can rebuild but no reader can read rows from
            if v.device.type != "cpu" or v.layout != torch.strided or v.is_quantized:
                what = "a meta tensor (no data)" if v.is_meta else f"a {v.layout} {v.device.type} tensor"
                raise DumpError(f"key '{k}': {what}; a dump holds dense tensors with their data", file=self.path)
        self._tensors = {str(k): v for k, v in obj.items()}
        self._shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        self._dtypes = {k: v.dtype for k, v in self._tensors.items()}

    def _open_npz(self, inflate_limit):
        """Only each member's .npy header is read (a few hundred bytes, inflated if compressed)."""

        self._zip = zipfile.ZipFile(self.path)
        self._shapes, self._dtypes = {}, {}
        for info in self._zip.infolist():
            if not info.filename.endswith(".npy"):
                continue
            key = info.filename[:-4]
            compressed = info.compress_type != zipfile.ZIP_STORED
            if inflate_limit is not None and compressed and info.file_size > inflate_limit:
                raise DumpError(f"{self.path}: key '{key}': compressed member inflates to {info.file_size:,} bytes "
                                f"({info.compress_size:,} stored), over the {inflate_limit:,}-byte limit; "
                                "pass --force to read it anyway")
            with self._zip.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                offset = f.tell()
            if dtype.hasobject:
                raise DumpError(f"{self.path}: key '{key}': holds Python objects (pickles are not read)")
            self._npy[key] = (info, dtype, fortran, offset)
            self._shapes[key] = checked_shape(tuple(int(s) for s in shape), f"{self.path}: key '{key}'")
            # numpy has no bfloat16: such dumps must use safetensors or .pt
            self._dtypes[key] = torch.from_numpy(np.zeros(0, dtype=dtype.newbyteorder("="))).dtype

    def _npz_get(self, key, start, stop) -> torch.Tensor:
        info, dtype, fortran, offset = self._npy[key]
        shape = self._shapes[key]
        rows = not (start is None and stop is None) and len(shape) > 0
        if fortran and rows and len(shape) >= 2:
            mm = self._row_major_copy(key)
            lo, hi = max(0, start), max(min(shape[0], stop), max(0, start))
            return torch.from_numpy(np.array(mm[lo:hi], order="C"))
        # a Fortran-ordered member has no contiguous rows: read whole (numpy never writes one unasked)
        lo, hi = (max(0, start), max(min(shape[0], stop), max(0, start))) if rows and not fortran \
            else (0, shape[0] if shape else 1)
        row_items = math.prod(shape[1:]) if shape else 1
        f = self._open_members.get(key)
        if f is None:  # kept open: chunks read in order continue where the last one stopped
            f = self._open_members[key] = self._zip.open(info)
        f.seek(offset + lo * row_items * dtype.itemsize)
        want = (hi - lo) * row_items * dtype.itemsize
        raw = f.read(want)
        if len(raw) != want:
            raise OSError(f"member ends {want - len(raw)} bytes early")
        a = np.frombuffer(raw, dtype=dtype)
        if fortran:
            a = a.reshape(shape, order="F")[start:stop] if rows else a.reshape(shape, order="F")
        else:
            a = a.reshape((hi - lo,) + tuple(shape[1:]) if shape else ())
        return torch.from_numpy(np.array(a, dtype=dtype.newbyteorder("="), order="C"))

    def _row_major_copy(self, key) -> np.ndarray:
        """A Fortran-ordered member's rows are spread over the whole member (column after column):
        read per chunk, every chunk would inflate the member again. It is copied once, column by
        column in one forward pass, into a row-major temp file mapped from disk (page cache, not
        anonymous memory); chunks are then rows of that map."""
        if key in self._row_major:
            return self._row_major[key][1]
        info, dtype, _, offset = self._npy[key]
        shape = self._shapes[key]
        native = dtype.newbyteorder("=")
        tmp = tempfile.TemporaryFile(prefix="mask-replay-npz-")
        try:
            tmp.truncate(max(1, math.prod(shape) * native.itemsize))
            mm = np.memmap(tmp, dtype=native, mode="r+", shape=shape, order="C")
            column = shape[0]
            flat = mm.reshape(shape[0], -1)  # Fortran order: the first index runs fastest
            with self._zip.open(info) as f:
                f.seek(offset)
                for j in range(flat.shape[1]):
                    raw = f.read(column * dtype.itemsize)
                    if len(raw) != column * dtype.itemsize:
                        raise OSError(f"member ends {column * dtype.itemsize - len(raw)} bytes early")
                    flat[:, _fortran_column(j, shape)] = np.frombuffer(raw, dtype=dtype)
            mm.flush()
        except BaseException:
            tmp.close()
            raise
        self._row_major[key] = (tmp, mm)
        return mm

    # ---- access ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, key) -> bool:
        return key in self._shapes

    def shape(self, key) -> tuple:
        return self._shapes[key]

    def dtype(self, key):
        return self._dtypes[key]

    def nbytes(self, key) -> int:
        dt = self._dtypes[key]
        size = torch.empty(0, dtype=dt).element_size() if isinstance(dt, torch.dtype) else 0
        return math.prod(self._shapes[key]) * size

    def get(self, key, start: Optional[int] = None, stop: Optional[int] = None, *,
            stream: bool = False) -> torch.Tensor:
        """Rows [start, stop) of `key` (the whole tensor when both are None); reads only those rows.

        stream=True (safetensors, for chunk loops over logits): the rows are a view of the file's
        memory map, with no copy, and the previous chunk of `key` is released from this process
        (MADV_DONTNEED), so resident memory stays one chunk whatever the file size (a plain map
        keeps every page read). Else the rows are copied out with pread."""

        whole = start is None and stop is None
        try:
            if self._header is not None:
                if stream and self._streamable and not whole:
                    return self._mapped_rows(key, start, stop)
                return pread_rows(self._fd, self._header, key, start, stop)
            if self._zip is not None:
                return self._npz_get(key, start, stop)
            t = self._tensors[key]
            if whole or t.dim() == 0:
                return t
            return t[start:stop].contiguous()
        except Exception as exc:  # a truncated data section shows up here, not at open
            where = "" if whole else f" rows {start}..{stop - 1}"
            raise DumpError(f"{self.path}: key '{key}':{where} cannot be read ({_first_line(exc)})") from exc

    def _mapped_rows(self, key, start, stop) -> torch.Tensor:
        dtype, shape, begin, _ = self._header.tensors[key]
        lo, hi = max(0, start), max(min(shape[0], stop), max(0, start))
        item = torch.empty(0, dtype=dtype).element_size()
        row_bytes = math.prod(shape[1:]) * item
        a = self._header.data_start + begin + lo * row_bytes
        self._release(key)
        out_shape = (hi - lo,) + tuple(shape[1:])
        if hi == lo:
            return torch.empty(out_shape, dtype=dtype)
        if a % item:  # a file whose writer did not align the data: copy instead
            return pread_rows(self._fd, self._header, key, start, stop)
        # one private (ACCESS_COPY: writable, for torch.frombuffer) map per chunk, not one of the whole
        # file: a private writable map is charged to the commit limit at its full length, so with
        # Linux's default overcommit a whole-file map of a dump larger than RAM + swap fails (ENOMEM).
        # Nothing writes to it, so its pages stay the page cache's.
        first = a - a % mmap.ALLOCATIONGRANULARITY
        n = (hi - lo) * row_bytes
        chunk = mmap.mmap(self._fd, a + n - first, access=mmap.ACCESS_COPY, offset=first)
        self._mapped[key] = chunk
        return torch.frombuffer(chunk, dtype=dtype, count=n // item, offset=a - first).view(out_shape)

    def _release(self, key) -> None:
        """Drop the pages of the last chunk handed out for `key` from this process's memory."""

        chunk = self._mapped.pop(key, None)
        if chunk is not None and hasattr(chunk, "madvise"):  # a tensor still viewing it refaults from the file
            chunk.madvise(mmap.MADV_DONTNEED)
        # never closed here: torch.frombuffer holds a reference to the map but no buffer export, so
        # close() would unmap it under a live tensor (a segfault on its next read); the map is
        # unmapped when the last tensor viewing it is freed

    def close(self):
        for key in list(self._mapped):
            self._release(key)
        if self._fd is not None:
            os.close(self._fd)
        for f in self._open_members.values():
            f.close()
        for tmp, _ in self._row_major.values():
            tmp.close()
        self._row_major = {}
        if self._zip is not None:
            self._zip.close()
        self._fd = self._header = self._zip = self._tensors = None
        self._streamable = False
        self._open_members, self._mapped = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- validation --------------------------------------------------------------------------
    def err(self, key, what, row: Optional[int] = None) -> DumpError:
        at = f" at row {row}" if row is not None else ""
        return DumpError(f"{self.path}: key '{key}': {what}{at}")

    def require_logits(self, vocab: Optional[int] = None) -> tuple[int, int]:
        """Check `logits` is [N, V] float; returns (N, V)."""
        if "logits" not in self:
            raise self.err("logits", f"missing (keys present: {', '.join(sorted(self.keys())) or 'none'})")
        shape, dt = self.shape("logits"), self.dtype("logits")
        if len(shape) != 2:
            raise self.err("logits", f"must be 2-D [rows, vocab], got shape {list(shape)}")
        if dt not in FLOAT_DTYPES:
            raise self.err("logits", f"must be float32, bfloat16 or float16, got {_dtname(dt)}")
        if shape[1] < 1:
            raise self.err("logits", "has an empty vocabulary dimension")
        if vocab is not None and shape[1] != vocab:
            raise self.err("logits", f"vocab size {shape[1]} does not match {vocab}")
        return shape[0], shape[1]

    def require_rollout(self) -> tuple[int, int]:
        """Check a rollout dump: logits, sampled and the optional per-row keys. Returns (N, V)."""
        n, v = self.require_logits()
        if "sampled" not in self:
            raise self.err("sampled", "missing (a rollout dump needs the sampled token of every row)")
        self._check_per_row("sampled", n, "int", scalar_ok=False)
        for key, kind in _PER_ROW_KINDS.items():
            if key in self:
                self._check_per_row(key, n, kind, scalar_ok=key in _SCALAR_OK)
        return n, v

    def _check_per_row(self, key, n, kind, scalar_ok):
        shape, dt = self.shape(key), self.dtype(key)
        if not (len(shape) == 1 and shape[0] == n) and not (scalar_ok and len(shape) == 0):
            want = f"[{n}]" + (" or a scalar" if scalar_ok else "")
            raise self.err(key, f"must have shape {want} (one value per logits row), got {list(shape)}")
        ok = INT_DTYPES if kind == "int" else FLOAT_DTYPES + (torch.float64,)
        if key in ("temperature", "top_p", "min_p"):
            ok = ok + INT_DTYPES  # e.g. temperature stored as an integer 1
        if dt not in ok:
            raise self.err(key, f"must be {'an integer' if kind == 'int' else 'a float'} dtype, got {_dtname(dt)}")


def _fortran_column(j: int, shape: tuple) -> int:
    """The C-order column (of the trailing dimensions flattened) of the j-th Fortran-order column:
    Fortran order lists the trailing indices with the second dimension fastest."""
    rest = shape[1:]
    idx, c = [], j
    for size in rest:  # Fortran: the earliest trailing dimension varies fastest
        idx.append(c % size)
        c //= size
    flat = 0
    for size, i in zip(rest, idx):  # C: the last dimension varies fastest
        flat = flat * size + i
    return flat


def check_sampled(dump: Dump, sampled: torch.Tensor, vocab: int, row0: int) -> None:
    """Sampled ids of rows [row0, row0 + len) must lie in [0, vocab)."""
    bad = torch.nonzero((sampled < 0) | (sampled >= vocab))
    if bad.numel():
        r = int(bad[0])
        raise dump.err("sampled", f"token id {int(sampled[r])} out of range [0, {vocab})", row0 + r)


def check_finite(dump: Dump, logits: torch.Tensor, row0: int, key: str = "logits") -> None:
    """NaN or +inf anywhere, or a row with no finite entry, is an error naming the absolute row."""
    # One pass in the common case: a row sum is finite unless the row holds NaN or +/-inf; only
    # those rows (-inf entries are legal, e.g. masked padding) are looked at closely.
    sums = logits.sum(dim=1, dtype=torch.float32)
    suspect = torch.nonzero(~torch.isfinite(sums)).flatten()
    if suspect.numel() == 0:
        return
    x = logits[suspect]
    bad = torch.isnan(x).any(1) | torch.isposinf(x).any(1) | torch.isneginf(x).all(1)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        row = x[i]
        what = ("NaN" if bool(torch.isnan(row).any()) else "+inf" if bool(torch.isposinf(row).any())
                else "no finite entry")
        raise dump.err(key, what, row0 + int(suspect[i]))


_ROW_RE = re.compile(r"\brow (\d+)")


def shift_row(message: str, row0: int) -> str:
    """Rewrite the chunk-relative 'row R' in a kernel message into the absolute row of the dump."""
    return _ROW_RE.sub(lambda m: f"row {row0 + int(m.group(1))}", _first_line(message), count=1)


def _first_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _dtname(dt) -> str:
    return str(dt).replace("torch.", "") if dt is not None else "object"
