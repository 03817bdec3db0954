"""A mask file read in row chunks: what `score` uses, so its memory does not grow with the supports.

SamplingMask.load reads every tensor; a mask of flat rows is as large as an fp32 dump (GBs). Here
only the per-row keys (offsets, sampled, logprobs, ...: a few bytes per row) are read whole; the
support ids of rows [a, b) are read with pread when those rows are scored, and checked then
(SamplingMask.validate on the chunk: ids in range and ascending, sampled in range). The checks
that need the whole file (offsets start at 0, never decrease, end at the number of ids; every
per-row key has one value per row) are made once at open, on the per-row keys only.
"""
from __future__ import annotations

import torch

from mask_replay.dumps import Dump, shift_row
from mask_replay.mask import _ROW_EXTRAS, MaskFormatError, SamplingMask, check_file_dtypes


class MaskFile:
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
        for key in ("token_ids", "offsets"):
            if key not in d:
                raise MaskFormatError(f"{path}: missing key '{key}' (is this a mask file?)")
        if d.dtype("token_ids") != torch.int32 or len(d.shape("token_ids")) != 1:
            raise MaskFormatError(f"{path}: key 'token_ids': must be a 1-D int32 tensor, got "
                                  f"{d.dtype('token_ids')} {list(d.shape('token_ids'))}")
        self.nnz = d.shape("token_ids")[0]
        per_row = {k: d.get(k) for k in d.keys() if k != "token_ids"}
        check_file_dtypes(per_row, path)
        o = per_row.pop("offsets")
        if o.dtype != torch.int64 or o.dim() != 1 or o.numel() < 1:
            raise MaskFormatError(f"{path}: offsets must be a 1-D int64 tensor of N+1 >= 1 entries, "
                                  f"got {o.dtype} {tuple(o.shape)}")
        if int(o[0]) != 0:
            raise MaskFormatError(f"{path}: offsets[0] must be 0, got {int(o[0])}")
        bad = torch.nonzero(o[1:] < o[:-1])
        if bad.numel():
            r = int(bad[0])
            raise MaskFormatError(f"{path}: offsets decrease at row {r} ({int(o[r])} -> {int(o[r + 1])})")
        if int(o[-1]) != self.nnz:
            raise MaskFormatError(f"{path}: offsets[-1] = {int(o[-1])} but token_ids has {self.nnz} entries")
        self.offsets = o
        self.num_rows = o.numel() - 1
        for k, v in per_row.items():
            if v.dim() != 1 or v.numel() != self.num_rows:
                raise MaskFormatError(f"{path}: {k} must have shape [{self.num_rows}], got {tuple(v.shape)}")
        named = {k: per_row.pop(k) for k in _ROW_EXTRAS if k in per_row}
        self.sampled = named.get("sampled")
        self.logprobs = named.get("logprobs")
        self.kept_mass = named.get("kept_mass")
        self.extras = per_row
        self.metadata = dict(self._dump.metadata)

    def rows(self, a: int, b: int, vocab_size: int) -> SamplingMask:
        """Rows [a, b) with their support ids, checked against the vocabulary."""
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        # a view of the file map, released when the next chunk is read (see Dump.get)
        sub = SamplingMask(self._dump.get("token_ids", lo, hi, stream=True), self.offsets[a: b + 1] - lo,
                           None if self.sampled is None else self.sampled[a:b].to(torch.int64))
        try:
            sub.validate(vocab_size=vocab_size, source=self.path)
        except MaskFormatError as exc:
            raise MaskFormatError(shift_row(str(exc), a)) from None
        return sub

    def close(self):
        self._dump.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
