"""The supports mask_replay's vLLM plugin attaches to each completion (`CompletionOutput.sampling_support`,
or the `sampling_support` field of an OpenAI-compatible choice), read and checked.

In memory (offline `LLM`, in-process engines) a support is a `SupportRows`: one completion's rows as CSR,
row t the ids (ascending) its token t was sampled from. Over HTTP the same in three fields:

    {"vocab_size": V, "token_ids": base64 of int32 little-endian [nnz],
     "offsets": base64 of int64 little-endian [rows + 1]}

so a row costs 4 bytes per id (plus a third more as base64), never a JSON number per entry.
`SamplingMask.from_vllm` reads either beside vLLM's own `sampling_mask`. vLLM is not imported here.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from mask_replay import csr
from mask_replay.errors import EngineOutputError, MaskFormatError
from mask_replay.sampler.adapters.common import _is_int, get, has

FIELD = "sampling_support"


@dataclass
class SupportRows:
    """One completion's supports as CSR: row t holds the ids token t was sampled from, ascending."""

    token_ids: np.ndarray  # int32 [nnz]
    offsets: np.ndarray  # int64 [rows + 1]
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return int(self.offsets.size) - 1


def support_to_json(support: SupportRows) -> dict:
    return {"vocab_size": int(support.vocab_size),
            "token_ids": base64.b64encode(np.ascontiguousarray(support.token_ids, dtype="<i4").tobytes()).decode(),
            "offsets": base64.b64encode(np.ascontiguousarray(support.offsets, dtype="<i8").tobytes()).decode()}


def _decoded(text, dtype: str, label: str, key: str) -> np.ndarray:
    if not isinstance(text, str):
        raise EngineOutputError(f"{label}: {FIELD}.{key} is {type(text).__name__}, expected base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise EngineOutputError(f"{label}: {FIELD}.{key} is not valid base64") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise EngineOutputError(f"{label}: {FIELD}.{key} holds {len(raw)} bytes, not a whole number of "
                                f"{size}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def support_rows(value, label: str) -> SupportRows:
    """A SupportRows (or its JSON) checked: offsets from 0 to nnz, never decreasing; ids in [0, V),
    strictly ascending within each row."""
    if isinstance(value, dict):
        vocab = value.get("vocab_size")
        ids = _decoded(value.get("token_ids"), "<i4", label, "token_ids")
        offsets = _decoded(value.get("offsets"), "<i8", label, "offsets")
    elif has(value, "token_ids") and has(value, "offsets"):
        vocab = get(value, "vocab_size")
        try:  # the values as recorded, widened (never narrowed: uint64 offsets would wrap their differences)
            ids, offsets = (csr.exact_int64(get(value, k), name=k, source=f"{label}: {FIELD}").numpy()
                            for k in ("token_ids", "offsets"))
        except MaskFormatError as exc:
            raise exc.at(cls=EngineOutputError) from None
    else:
        raise EngineOutputError(f"{label}: {FIELD} is a {type(value).__name__}, expected token_ids, offsets and "
                                "vocab_size")
    if not _is_int(vocab) or not 1 <= vocab <= csr.INT32_LIMIT:
        raise EngineOutputError(f"{label}: {FIELD}.vocab_size is {vocab!r}, expected a positive integer (ids are "
                                "int32: at most 2^31)")
    if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != ids.size or bool((np.diff(offsets) < 0).any()):
        raise EngineOutputError(f"{label}: {FIELD}.offsets must rise from 0 to the {ids.size} ids")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise EngineOutputError(f"{label} token {row}: {FIELD} id {int(ids[bad[0]])} is outside [0, {vocab})")
    rising = np.diff(ids.astype(np.int64)) > 0
    starts = offsets[1:-1]
    rising[starts[(starts > 0) & (starts < ids.size)] - 1] = True  # a row's first id may be below the last one's
    if not bool(rising.all()):
        i = int(np.flatnonzero(~rising)[0]) + 1
        row = int(np.searchsorted(offsets, i, side="right")) - 1
        raise EngineOutputError(f"{label} token {row}: {FIELD} ids are not strictly ascending")
    return SupportRows(ids.astype(np.int32, copy=False), offsets.astype(np.int64, copy=False), int(vocab))
