"""`convert`: engine responses, padded files and mask files into a mask file or a padded file.

A padded file into a mask file and a mask file into a padded file go chunk by chunk
(files.padded_file), in memory bounded by a chunk of rows; engine JSON is read whole (the JSON
parser holds it anyway)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from mask_replay.errors import DumpError, EngineOutputError
from mask_replay.files.engine_json import read_engine_json
from mask_replay.files.padded_file import load_padded, mask_file_to_padded, padded_to_mask_file, save_padded
from mask_replay.files.safe_output import check_writable
from mask_replay.mask import SamplingMask

SOURCES = ("vllm-json", "sglang-json", "padded", "mask")
TARGETS = ("mask", "padded")
ENGINE_SOURCES = ("vllm-json", "sglang-json")


@dataclass
class ConvertSummary:
    rows: int
    nnz: int
    widest_row: int
    sequences: int
    has_logprobs: bool


class Tally:
    """ConvertSummary of a mask seen whole or a chunk at a time (the distinct sequence ids are kept:
    8 bytes a sequence, not a row)."""

    def __init__(self):
        self.rows = self.nnz = self.widest = 0
        self.has_logprobs = False
        self._sequences = None  # the distinct sequence ids seen so far

    def add(self, mask: SamplingMask) -> None:
        self.rows += mask.num_rows
        self.nnz += mask.nnz
        if mask.num_rows:
            self.widest = max(self.widest, int(mask.lengths().max()))
            if "sequence" in mask.extras:
                seen = mask.extras["sequence"].cpu().unique()
                self._sequences = seen if self._sequences is None else torch.cat([self._sequences, seen]).unique()
        self.has_logprobs = mask.logprobs is not None

    def summary(self) -> ConvertSummary:
        return ConvertSummary(self.rows, self.nnz, self.widest,
                              0 if self._sequences is None else int(self._sequences.numel()), self.has_logprobs)


def read_source(path: str, source: str, *, temperature=None, step=None, vocab_size: Optional[int] = None):
    """The mask that `path` holds, read as `source` (one of SOURCES)."""
    if source == "mask":
        return SamplingMask.load(path)
    if source == "padded":
        return load_padded(path)
    read = SamplingMask.from_vllm if source == "vllm-json" else SamplingMask.from_sglang
    try:
        return read(read_engine_json(path), temperature=temperature, step=step, vocab_size=vocab_size)
    except EngineOutputError as exc:
        raise exc.at(file=path) from None


def convert_file(input_path: str, output: str, *, source: str, target: str, width: Optional[int] = None,
                 temperature=None, step=None, vocab_size: Optional[int] = None,
                 chunk_rows: Optional[int] = None) -> ConvertSummary:
    """Read `input_path` as `source`, write `output` as `target` (atomically). A padded output wider
    than `width` raises ValueError (not a DumpError: the width is the caller's, not the file's).
    Padded -> mask and mask -> padded go `chunk_rows` rows at a time (default: files.padded_file's
    chunk budget) and write the bytes the whole-mask path writes."""
    if os.path.exists(output) and os.path.exists(input_path) and os.path.samefile(input_path, output):
        raise DumpError("the output would overwrite the input", file=output)
    check_writable(output)
    tally = Tally()
    if (source, target) == ("padded", "mask"):
        padded_to_mask_file(input_path, output, vocab_size=vocab_size, chunk_rows=chunk_rows, each=tally.add)
        return tally.summary()
    if (source, target) == ("mask", "padded"):
        mask_file_to_padded(input_path, output, width, vocab_size=vocab_size, chunk_rows=chunk_rows, each=tally.add)
        return tally.summary()
    mask = read_source(input_path, source, temperature=temperature, step=step, vocab_size=vocab_size)
    if vocab_size is not None and source not in ENGINE_SOURCES:
        mask.validate(vocab_size=vocab_size, source=input_path)
    if target == "padded":
        save_padded(mask, output, width)
    else:
        mask.save(output)
    tally.add(mask)
    return tally.summary()
