"""`convert`: engine responses, padded files and mask files into a mask file or a padded file."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mask_replay.errors import DumpError, EngineOutputError
from mask_replay.files.engine_json import read_engine_json
from mask_replay.files.padded_file import load_padded, save_padded
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
                 temperature=None, step=None, vocab_size: Optional[int] = None) -> ConvertSummary:
    """Read `input_path` as `source`, write `output` as `target` (atomically). A padded output wider
    than `width` raises ValueError (not a DumpError: the width is the caller's, not the file's)."""
    if os.path.exists(output) and os.path.exists(input_path) and os.path.samefile(input_path, output):
        raise DumpError("the output would overwrite the input", file=output)
    check_writable(output)
    mask = read_source(input_path, source, temperature=temperature, step=step, vocab_size=vocab_size)
    if vocab_size is not None and source not in ENGINE_SOURCES:
        mask.validate(vocab_size=vocab_size, source=input_path)
    if target == "padded":
        save_padded(mask, output, width)
    else:
        mask.save(output)
    lengths = mask.lengths()
    sequences = int(mask.extras["sequence"].unique().numel()) if "sequence" in mask.extras and mask.num_rows else 0
    return ConvertSummary(mask.num_rows, mask.nnz, int(lengths.max()) if mask.num_rows else 0, sequences,
                          mask.logprobs is not None)
