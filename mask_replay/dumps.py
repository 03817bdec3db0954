"""Reading rollout and training dumps: lazy row slices, and validation whose errors name file/key/row.

A dump is a flat mapping key -> tensor in one of three containers:
  .safetensors  rows are read lazily (safe_open + get_slice), so a dump larger than RAM streams;
  .pt           torch.load(weights_only=True, mmap=True): a dict of tensors, pages read on demand;
  .npz          numpy.load: each key is read whole on first use (npz members cannot be memory-mapped).
The formats are described in docs/formats.md.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import numpy as np
import torch

from mask_replay.io import DumpError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Optional per-row keys of a rollout dump and what they must hold.
PARAM_KEYS = ("temperature", "top_k", "top_p", "min_p")
_PER_ROW_KINDS = {
    "temperature": "float", "top_k": "int", "top_p": "float", "min_p": "float",
    "rollout_logprobs": "float", "step": "int", "sequence": "int",
}
# Keys that may be 0-dim (one value for all rows); the others must be [N].
_SCALAR_OK = set(PARAM_KEYS)

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Dump:
    """One dump file opened for lazy row access. Use as a context manager or call close()."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.name = self.path
        if not os.path.exists(self.path):
            raise DumpError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise DumpError(f"{self.path}: is a folder, expected a dump file")
        ext = os.path.splitext(self.path)[1].lower()
        self._st = None  # safetensors handle
        self._tensors = None  # dict of tensors (.pt) or np arrays (.npz)
        self.metadata: dict = {}
        try:
            if ext == ".pt" or ext == ".pth":
                self._open_pt()
            elif ext == ".npz":
                self._open_npz()
            else:  # .safetensors, and any other name: safetensors is the primary format
                self._open_safetensors()
        except DumpError:
            raise
        except Exception as exc:  # each backend has its own error types for corrupt files
            raise DumpError(f"{self.path}: not a readable {ext or 'safetensors'} dump ({_first_line(exc)})") from exc

    # ---- backends ----------------------------------------------------------------------------
    def _open_safetensors(self):
        from safetensors import safe_open

        self._st = safe_open(self.path, framework="pt")
        self.metadata = dict(self._st.metadata() or {})
        self._shapes = {}
        self._dtypes = {}
        for k in self._st.keys():
            sl = self._st.get_slice(k)
            self._shapes[k] = tuple(sl.get_shape())
            self._dtypes[k] = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())

    def _open_pt(self):
        obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise DumpError(f"{self.path}: a .pt dump must hold a dict of tensors, got {type(obj).__name__}")
        self._tensors = {str(k): v for k, v in obj.items()}
        self._shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        self._dtypes = {k: v.dtype for k, v in self._tensors.items()}

    def _open_npz(self):
        arrays = np.load(self.path, allow_pickle=False)
        self._tensors = {}
        self._shapes = {}
        self._dtypes = {}
        for k in arrays.files:
            a = arrays[k]
            # numpy has no bfloat16: such dumps must use safetensors or .pt
            self._tensors[k] = a
            self._shapes[k] = tuple(a.shape)
            self._dtypes[k] = torch.from_numpy(np.zeros(0, dtype=a.dtype)).dtype if a.dtype != object else None

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
        return int(np.prod(self._shapes[key], dtype=np.int64)) * size

    def get(self, key, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) of `key` (the whole tensor when both are None); reads only those rows."""
        whole = start is None and stop is None
        try:
            if self._st is not None:
                if whole or len(self._shapes[key]) == 0:
                    return self._st.get_tensor(key)
                return self._st.get_slice(key)[start:stop]
            t = self._tensors[key]
            if isinstance(t, np.ndarray):
                # (np.ascontiguousarray would turn a 0-dim array into shape [1])
                t = torch.from_numpy(t if t.flags.c_contiguous else t.copy(order="C"))
            if whole or t.dim() == 0:
                return t
            return t[start:stop].contiguous()
        except Exception as exc:  # a truncated data section shows up here, not at open
            where = "" if whole else f" rows {start}..{stop - 1}"
            raise DumpError(f"{self.path}: key '{key}':{where} cannot be read ({_first_line(exc)})") from exc

    def close(self):
        self._st = None
        self._tensors = None

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
