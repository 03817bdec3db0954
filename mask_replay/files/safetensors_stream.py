"""Safetensors files written chunk by chunk and read by pread, with bounded memory.

Writing. The safetensors layout is `u64 header length | JSON header | data`, and the header holds
every tensor's byte range, so a tensor whose length is only known at the end (a mask's
`token_ids`) cannot simply be appended. StreamWriter reserves the header's room up front, sized for
the longest that tensor may grow (the JSON with the largest numbers, padded with spaces, which the
format allows), then lays the data out as

    head tensors (sizes known up front, written at their place chunk by chunk)
    the growing tensor (appended chunk by chunk)
    a second growing tensor, optional (`spooled`: appended to a temporary file chunk by chunk, copied
        after the first in bounded blocks by finish(), since its place is known only then)
    tail tensors (small, written at the end: their place depends on the growing tensor's length)

and writes the real header last. Head tensors are ordered by element size (largest first) and
tail tensors are the 1- and 2-byte ones, so every tensor stays aligned to its element size, as the
reference writer keeps them. Keys of the header and of the metadata are sorted, and nothing else
varies, so identical runs write identical bytes (the reference writer's metadata order follows a
hash map).

Reading. `Header` parses and checks a header; `pread_rows` copies rows [a, b) of one tensor into a
fresh buffer with os.preadv (dumps.Dump maps the file for its chunk loops and releases each
chunk's pages after use: a plain map grows the resident set one-for-one with the bytes read).
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from typing import Optional

import torch
from safetensors import safe_open

from mask_replay.errors import DumpError
from mask_replay.files.safe_output import atomic_file

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
MAX_HEADER = 100 << 20  # the reference reader's limit
SPOOL_BLOCK = 8 << 20  # bytes per copy step of a spooled tensor into the file


def _size(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
# The most elements a tensor of a file may declare (2^48: no disk holds more bytes). Shapes are checked
# and multiplied as Python integers: numpy's int64 product wraps silently (a [8, 2^61] tensor "holds 0
# bytes") and a later torch call dies on the size.
MAX_ELEMENTS = 1 << 48


def is_count(x) -> bool:
    """A non-negative integer as JSON gives it (not a bool, not a float such as 1e30 or 2.5)."""
    return type(x) is int and x >= 0


def checked_shape(shape, where: str) -> tuple:
    """`shape` as a tuple of ints, each dimension and every product of trailing dimensions (a row) at
    most MAX_ELEMENTS; DumpError naming `where` otherwise."""
    if not isinstance(shape, (list, tuple)) or not all(is_count(s) for s in shape):
        raise DumpError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    count = 1
    for s in reversed(shape):  # every row size (a product of trailing dimensions) stays bounded too
        count *= s
        if s > MAX_ELEMENTS or count > MAX_ELEMENTS:
            raise DumpError(f"{where}: shape {list(shape)} declares more than 2^48 elements")
    return tuple(shape)


def _code(dtype) -> str:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"safetensors: cannot store dtype {dtype}")
    return DTYPE_CODES[dtype]


def _header_json(entries: list, metadata: Optional[dict]) -> bytes:
    """entries: (name, dtype, shape, start, end)."""
    h = {}
    if metadata:
        h["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape, start, end in entries:
        h[name] = {"dtype": _code(dtype), "shape": [int(s) for s in shape], "data_offsets": [int(start), int(end)]}
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def _padded(text: bytes, size: int) -> bytes:
    return text + b" " * (size - len(text))


class StreamWriter:
    """Writes one safetensors file into a seekable binary file object `f`.

    head: {name: (dtype, shape)} of tensors written with write_rows (or write);
    growing: (name, dtype, max_len) of the 1-D tensor appended with append, or None;
    tail_room: {name: (dtype, shape)} of tensors finish() may be given (room is reserved for all);
    metadata_room: bytes of header kept for metadata that finish() adds (known only at the end);
    spooled: (name, dtype, max_len) of a second 1-D growing tensor, appended with append_spooled
    (its element size at most the growing tensor's, so it stays aligned after it).
    """

    def __init__(self, f, head: dict, growing=None, tail_room: Optional[dict] = None,
                 metadata: Optional[dict] = None, metadata_room: int = 0, spooled=None):
        self.f = f
        self.spooled = spooled
        self._spool = None
        self._spooled = 0  # elements appended to the spool so far
        if spooled is not None:
            if growing is None or _size(spooled[1]) > _size(growing[1]):
                raise ValueError("safetensors: a spooled tensor needs a growing tensor of at least its alignment")
            # next to the output (same filesystem, same free space); unlinked at once on POSIX
            name = getattr(f, "name", None)
            self._spool = tempfile.TemporaryFile(dir=(os.path.dirname(name) or None) if isinstance(name, str) else None)
        self.metadata = dict(metadata or {})
        self.head = sorted(head.items(), key=lambda kv: (-torch.empty(0, dtype=kv[1][0]).element_size(), kv[0]))
        self.growing = growing
        self.tail_room = dict(tail_room or {})
        if growing is not None:
            gsize = torch.empty(0, dtype=growing[1]).element_size()
            if self.head and gsize > min(torch.empty(0, dtype=dt).element_size() for _, (dt, _) in self.head):
                raise ValueError("safetensors: the growing tensor must not need more alignment than the head")
        self._place = {}
        pos = 0
        for name, (dtype, shape) in self.head:
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            self._place[name] = (dtype, tuple(shape), pos, pos + nbytes)
            pos += nbytes
        self._grow_start = pos
        self._grown = 0  # elements appended so far
        self._tail_place = None  # tail tensors written with write_tail_rows: name -> place
        # Room for the largest header finish() can write: the growing tensor at max_len, every tail
        # tensor present; rounded up to 8 so the data starts aligned.
        worst = self._entries(growing[2] if growing else 0, self.tail_room, spooled[2] if spooled else 0)
        self.header_size = -(-(len(_header_json(worst, self.metadata)) + metadata_room) // 8) * 8
        self.data_start = 8 + self.header_size

    def _entries(self, grown: int, tail: dict, spooled: int = 0) -> list:
        entries = [(n, dt, sh, a, b) for n, (dt, sh, a, b) in self._place.items()]
        pos = self._grow_start
        if self.growing is not None:
            name, dtype, _ = self.growing
            end = pos + grown * torch.empty(0, dtype=dtype).element_size()
            entries.append((name, dtype, (grown,), pos, end))
            pos = end
        if self.spooled is not None:
            name, dtype, _ = self.spooled
            end = pos + spooled * _size(dtype)
            entries.append((name, dtype, (spooled,), pos, end))
            pos = end
        for name in sorted(tail, key=lambda n: (-torch.empty(0, dtype=tail[n][0]).element_size(), n)):
            dtype, shape = tail[name]
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            entries.append((name, dtype, tuple(shape), pos, pos + nbytes))
            pos += nbytes
        return entries

    def _pwrite(self, pos: int, t: torch.Tensor) -> None:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self.f.seek(self.data_start + pos)
        self.f.write(memoryview(data))

    def write_rows(self, name: str, row0: int, t: torch.Tensor) -> None:
        """Rows [row0, row0 + len(t)) of head tensor `name`."""
        self._write_rows_at(self._place[name], name, row0, t)

    def _fix_tail(self) -> None:
        """Every tensor of tail_room present, at a place known from the start (no growing tensor):
        then write_tail_rows writes them before finish(), which is given no tail."""
        if self.growing is not None or self.spooled is not None:
            raise ValueError("safetensors: a fixed tail needs a file without growing tensors")
        self._tail_place = {e[0]: e[1:] for e in self._entries(0, self.tail_room) if e[0] in self.tail_room}

    def write_tail_rows(self, name: str, row0: int, t: torch.Tensor) -> None:
        """Rows [row0, row0 + len(t)) of tail tensor `name` of a fixed_writer file."""
        if self._tail_place is None:
            raise ValueError("safetensors: tail rows are written before finish() only in a fixed_writer file")
        self._write_rows_at(self._tail_place[name], name, row0, t)

    def _write_rows_at(self, place, name: str, row0: int, t: torch.Tensor) -> None:
        dtype, shape, start, end = place
        t = t.to(dtype)
        row_bytes = math.prod(shape[1:]) * t.element_size()
        pos = start + row0 * row_bytes
        if pos + t.numel() * t.element_size() > end:
            raise ValueError(f"safetensors: rows {row0}.. of '{name}' overflow its shape {list(shape)}")
        self._pwrite(pos, t)

    def write(self, name: str, t: torch.Tensor) -> None:
        self.write_rows(name, 0, t.reshape(self._place[name][1]))

    def append(self, t: torch.Tensor) -> None:
        name, dtype, max_len = self.growing
        t = t.to(dtype).reshape(-1)
        if self._grown + t.numel() > max_len:
            raise ValueError(f"safetensors: '{name}' grows past the {max_len} entries reserved")
        self._pwrite(self._grow_start + self._grown * t.element_size(), t)
        self._grown += t.numel()

    def append_spooled(self, t: torch.Tensor) -> None:
        name, dtype, max_len = self.spooled
        t = t.to(dtype).reshape(-1)
        if self._spooled + t.numel() > max_len:
            raise ValueError(f"safetensors: '{name}' grows past the {max_len} entries reserved")
        if t.numel():
            self._spool.write(memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()))
        self._spooled += t.numel()

    def _copy_spool(self, pos: int) -> None:
        """The spooled tensor's bytes to data offset `pos`, in blocks (memory stays bounded)."""
        self._spool.seek(0)
        self.f.seek(self.data_start + pos)
        while True:
            block = self._spool.read(SPOOL_BLOCK)
            if not block:
                break
            self.f.write(block)
        self._spool.close()

    def finish(self, tail: Optional[dict] = None, metadata: Optional[dict] = None) -> None:
        if metadata:
            self.metadata.update(metadata)
        tail = {k: v.detach().cpu().contiguous() for k, v in (tail or {}).items()}
        for name, t in tail.items():
            if self._tail_place is not None:
                raise ValueError(f"safetensors: tail tensor '{name}' of a fixed_writer file goes through "
                                 "write_tail_rows, not finish()")
            if name not in self.tail_room:
                raise ValueError(f"safetensors: no room reserved for tail tensor '{name}'")
        shapes = {k: (v.dtype, tuple(v.shape)) for k, v in tail.items()}
        if self._tail_place is not None:  # a fixed tail: every tensor present, written in place already
            shapes = {k: (dt, sh) for k, (dt, sh, _, _) in self._tail_place.items()}
        entries = self._entries(self._grown, shapes, self._spooled)
        for name, dtype, shape, start, end in entries:
            if name in tail:
                self._pwrite(start, tail[name])
            elif self.spooled is not None and name == self.spooled[0]:
                self._copy_spool(start)
        end = max((e[4] for e in entries), default=0)
        header = _header_json(entries, self.metadata)
        if len(header) > self.header_size:  # metadata added at the end outgrew its reserved room
            raise ValueError(f"safetensors: header of {len(header)} bytes exceeds the {self.header_size} reserved")
        self.f.truncate(self.data_start + end)  # the data must end exactly where the header says
        self.f.seek(0)
        self.f.write(struct.pack("<Q", self.header_size) + _padded(header, self.header_size))
        self.f.flush()


def fixed_writer(f, specs: dict, metadata: Optional[dict] = None) -> StreamWriter:
    """A StreamWriter for tensors whose dtypes and shapes are all known up front, {name: (dtype,
    shape)}, in write_file's layout (tensors of 4 and 8 bytes in the head, the 1- and 2-byte ones in
    the tail): written chunk by chunk with write_rows / write_tail_rows, the file has the bytes
    save() gives the same tensors."""
    small = {k: v for k, v in specs.items() if _size(v[0]) < 4}
    w = StreamWriter(f, {k: v for k, v in specs.items() if k not in small}, tail_room=small, metadata=metadata)
    w._fix_tail()
    return w


def write_file(f, tensors: dict, metadata: Optional[dict] = None) -> None:
    """All of `tensors` into the open binary file `f`, in the stable layout of StreamWriter."""
    tensors = {str(k): v.detach().cpu().contiguous() for k, v in tensors.items()}
    w = fixed_writer(f, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata)
    for k, v in tensors.items():
        if k in w.tail_room:
            w.write_tail_rows(k, 0, v)
        else:
            w.write(k, v)
    w.finish()


def save(path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Write a safetensors file atomically (see mask_replay.files.safe_output.atomic_file). Every
    safetensors file the project writes goes through here or StreamWriter: same bytes for the same
    tensors and metadata."""
    with atomic_file(path) as f:
        write_file(f, tensors, metadata)


class Header:
    """The parsed header of a safetensors file: {name: (dtype, shape, start, end)}, metadata,
    data_start. Checks what the reference reader checks (sizes agree with shapes, ranges tile the
    data section exactly)."""

    def __init__(self, path: str, fd: int):
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) < 8:
            raise DumpError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise DumpError(f"{path}: safetensors header length {n} does not fit the file ({size} bytes)")
        try:
            h = json.loads(os.pread(fd, n, 8))
        except ValueError as exc:
            raise DumpError(f"{path}: safetensors header is not JSON ({exc})") from exc
        if not isinstance(h, dict):
            raise DumpError(f"{path}: safetensors header is not a JSON object")
        self.metadata = h.pop("__metadata__", None) or {}
        # as the reference reader: metadata is a map of strings to strings
        if not isinstance(self.metadata, dict):
            raise DumpError(f"{path}: safetensors header __metadata__ is a JSON {type(self.metadata).__name__}, "
                            "expected an object of strings")
        for k, v in self.metadata.items():
            if not isinstance(v, str):
                raise DumpError(f"{path}: safetensors header __metadata__ '{k}' is a JSON {type(v).__name__}, "
                                "expected a string")
        self.data_start = 8 + n
        self.tensors = {}
        spans = []
        for name, e in h.items():
            try:
                dtype = CODE_DTYPES[e["dtype"]]
                offsets = e["data_offsets"]
                if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(x) for x in offsets):
                    raise ValueError("data_offsets")
                start, end = offsets
            except (KeyError, TypeError, ValueError) as exc:
                raise DumpError(f"{path}: key '{name}': malformed safetensors header entry") from exc
            shape = checked_shape(e.get("shape"), f"{path}: key '{name}'")
            if end - start != math.prod(shape) * torch.empty(0, dtype=dtype).element_size():
                raise DumpError(f"{path}: key '{name}': byte range does not match shape {list(shape)}")
            self.tensors[name] = (dtype, shape, start, end)
            spans.append((start, end))
        pos = 0
        for start, end in sorted(spans):
            if start != pos:
                raise DumpError(f"{path}: safetensors data ranges overlap or leave a gap at byte {pos}")
            pos = end
        if self.data_start + pos != size:
            raise DumpError(f"{path}: data section is {size - self.data_start} bytes, the header says {pos}")


def pread_rows(fd: int, header: Header, name: str, start: Optional[int], stop: Optional[int]) -> torch.Tensor:
    """Rows [start, stop) of tensor `name` (all of it when both are None), copied with preadv into
    a fresh tensor: nothing of the file stays mapped."""
    dtype, shape, begin, _ = header.tensors[name]
    if start is None and stop is None or len(shape) == 0:
        lo, hi, out_shape = 0, (shape[0] if shape else 1), shape
    else:
        lo, hi = max(0, start), min(shape[0], stop)
        hi = max(hi, lo)
        out_shape = (hi - lo,) + shape[1:]
    out = torch.empty(out_shape, dtype=dtype)
    if out.numel() == 0:
        return out
    row_bytes = math.prod(shape[1:]) * out.element_size() if shape else out.element_size()
    buf = out.reshape(-1).view(torch.uint8).numpy()
    pos, done = header.data_start + begin + lo * row_bytes, 0
    while done < buf.size:
        got = os.preadv(fd, [buf[done:]], pos + done)
        if got <= 0:
            raise OSError(f"file ends {buf.size - done} bytes early")
        done += got
    return out


def read_all(path):
    """All tensors and the metadata of a small safetensors file (a mask loaded whole), read by the
    safetensors library's own reader; DumpError on a bad or truncated file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except DumpError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers/data
        raise DumpError(f"{path}: not a readable safetensors file ({exc})") from exc
    return tensors, meta
