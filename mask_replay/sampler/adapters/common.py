"""What the engine adapters share: reading duck-typed fields, and turning per-completion mask rows
into the fields of one SamplingMask, with errors that name the request, the choice and the token.

The adapters build SamplingMask directly; SamplingMask.from_vllm / from_sglang / from_padded are
their public face (each adapter registers itself with mask.adapter; mask.py never imports this layer).

An engine reports, per generated token, the ids its sampler could have drawn (in any order); the
adapters turn that into CSR rows (ids ascending), one row per generated token, requests in the
order given, completions by index, tokens in order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Sequence

import numpy as np
import torch

from mask_replay import csr
from mask_replay.csr import LOGPROB_MARGIN
from mask_replay.errors import EngineOutputError, MaskFormatError
from mask_replay.mask import SamplingMask
from mask_replay.params import _F32_TO_INF, _float32_problem

INT32_LIMIT = 2**31



def get(obj: Any, name: str, default=None):
    """A field of a JSON dict or of an engine object (duck typing: vLLM need not be installed)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def has(obj: Any, name: str) -> bool:
    return (name in obj) if isinstance(obj, dict) else hasattr(obj, name)


def as_list(value: Any, what: str) -> list:
    """A row sequence as a Python list: lists and tuples as they are, numpy arrays and tensors via
    tolist() (engines may hand out either)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # array.array, FlatLogprobs...
        return list(value)
    raise EngineOutputError(f"{what}: expected a list, got {type(value).__name__}")


def _is_int(x) -> bool:
    # bool is an int subclass in Python, but a True in a list of token ids is a bug upstream
    return (type(x) is int) or isinstance(x, np.integer)


def _is_real(x) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool))


@dataclass
class Completion:
    """One generated sequence as the engine reported it (rows not yet checked)."""

    label: str  # "request 0 (id 'r0') choice 1": how errors name it
    tokens: Any  # generated token ids
    rows: Any = None  # mask rows, one per token (None: the engine returned no mask)
    token_logprobs: Any = None  # processed log-prob of each generated token, or None
    entry_logprobs: Any = None  # log-prob of every mask entry, rows like `rows`, or None
    key: list = field(default_factory=list)  # JSON-able identity, kept in the metadata


@dataclass
class _Parsed:
    """The completions' rows, flattened in order, not yet sorted or checked against each other."""

    ids: np.ndarray  # int64 [nnz], each row's ids in the engine's order
    counts: np.ndarray  # int64 [rows]
    sampled: np.ndarray  # int64 [rows]
    sequence: np.ndarray  # int64 [rows]: index of the completion
    position: np.ndarray  # int64 [rows]: token index within its completion
    starts: np.ndarray  # first row of each completion, and the total
    token_logprobs: list  # per completion: the per-token log-probs, or None
    entry_logprobs: list  # per completion: the per-entry log-probs, or None
    tokens: list  # per completion: number of rows
    entries: list  # per completion: number of mask entries


def build_mask(completions: Sequence[Completion], *, engine: str, temperature=None, step=None,
               vocab_size: Optional[int] = None) -> SamplingMask:
    """One mask row per generated token of every completion, in order.

    extras: `sequence` (index of the completion in that order), `position` (token index within
    its completion), `step` and `temperature` when given. `logprobs` is the log-prob of the
    sampled token over its mask: from the per-entry mask log-probs when the engine sent them,
    else from the per-token log-probs; 0 for a one-id mask (single_id_rows_certain); NaN for a token
    with an empty mask and no per-token value.
    """
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
        raise EngineOutputError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    parsed = _parse(completions)
    n_rows = int(parsed.counts.size)
    where = _Locator(completions, parsed.starts)
    if n_rows >= INT32_LIMIT:
        raise EngineOutputError(f"{n_rows} generated tokens: more than 2^31 - 1 rows in one mask")
    row_of = np.repeat(np.arange(n_rows, dtype=np.int64), parsed.counts)
    _check_ids(parsed.ids, row_of, parsed.sampled, vocab_size, where)
    ids, order, found, pos = _sort_rows(parsed, row_of, where)
    logprobs, source, entry_lp = _row_logprobs(parsed.token_logprobs, parsed.entry_logprobs, order, found, pos,
                                               parsed.tokens, parsed.entries, completions)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(parsed.counts, out=offsets[1:])
    extras = {"sequence": torch.from_numpy(parsed.sequence), "position": torch.from_numpy(parsed.position)}
    extras.update(row_extras(n_rows, step=step, temperature=temperature))
    meta = {"engine": engine, "logprobs_source": source, "sequences": [c.key for c in completions]}
    if vocab_size is not None:
        meta["vocab_size"] = int(vocab_size)
    mask = single_id_rows_certain(SamplingMask(
        torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(offsets),
        sampled=torch.from_numpy(parsed.sampled), logprobs=logprobs, extras=extras, metadata=meta,
        entry_logprobs=entry_lp))
    if entry_lp is not None:  # NaN, +inf or a row that is not a distribution: named by its row
        try:  # (a one-id row is at 0 by now: the engine's value there is checked as a number only)
            csr.check_entry_logprobs(mask.entry_logprobs, mask.offsets, source="sampling-mask log-probs")
        except MaskFormatError as exc:
            if exc.row is None:  # not a row's values (the counts were checked above): say it as it is
                raise EngineOutputError(f"sampling-mask log-probs: {exc.problem}") from None
            raise EngineOutputError(f"{where(exc.row)}: {exc.problem.replace('{row}', str(exc.row))}") from None
    return mask


def single_id_rows_certain(mask: SamplingMask) -> SamplingMask:
    """Every row whose support is one id (its sampled token, checked) at log-prob 0, in `logprobs` and
    `entry_logprobs`: that is the log-prob over the support, whatever the engine's field says (vLLM
    reports a greedy row's log-prob over the whole vocabulary, -1.119 for a token whose ratio is 1;
    mask_from_vllm_logprobs writes 0 for the same row). So every reader of one generation agrees."""
    one = mask.lengths() == 1
    if mask.logprobs is not None:
        mask.logprobs = mask.logprobs.masked_fill(one, 0.0)
    if mask.entry_logprobs is not None and mask.nnz:
        mask.entry_logprobs = mask.entry_logprobs.index_fill(0, mask.offsets[:-1][one], 0.0)
    return mask


def _parse(completions: Sequence[Completion]) -> _Parsed:
    ids_parts, count_parts, tok_parts, tlp_parts, elp_parts = [], [], [], [], []
    seq_parts, pos_parts, starts = [], [], [0]
    n_tok, n_ent = [], []
    for ci, c in enumerate(completions):
        tokens = _int_list(as_list(c.tokens, f"{c.label}: token_ids") if c.tokens is not None else [],
                           f"{c.label}: token_ids", "token")
        n = len(tokens)
        if _is_csr(c.rows):  # checked CSR (adapters.vllm_support): no Python object per entry
            counts = np.diff(c.rows.offsets).astype(np.int64)
            if counts.size != n:
                raise EngineOutputError(f"{c.label}: {counts.size} support rows for {n} generated tokens")
            flat = c.rows.token_ids.astype(np.int64)
        else:
            rows = _mask_rows(c, n)
            counts = np.fromiter(map(len, rows), dtype=np.int64, count=n)
            flat = _int_list(list(chain.from_iterable(rows)), f"{c.label}", "mask entry", counts=counts)
        ids_parts.append(flat)
        count_parts.append(counts)
        tok_parts.append(tokens)
        tlp_parts.append(_token_logprobs(c, n))
        elp_parts.append(_entry_logprobs(c, counts))
        n_tok.append(n)
        n_ent.append(int(flat.size))
        seq_parts.append(np.full(n, ci, dtype=np.int64))
        pos_parts.append(np.arange(n, dtype=np.int64))
        starts.append(starts[-1] + n)

    def cat(parts):
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)

    return _Parsed(cat(ids_parts), cat(count_parts), cat(tok_parts), cat(seq_parts), cat(pos_parts),
                   np.asarray(starts), tlp_parts, elp_parts, n_tok, n_ent)


def _is_csr(rows) -> bool:
    return isinstance(getattr(rows, "token_ids", None), np.ndarray) and isinstance(getattr(rows, "offsets", None),
                                                                                   np.ndarray)


def _mask_rows(c: Completion, n: int) -> list:
    """The completion's mask rows as lists, one per generated token."""
    if c.rows is None:
        if n:
            raise EngineOutputError(f"{c.label}: no sampling mask for its {n} generated tokens (vLLM: start it with "
                                    "MASK_REPLAY_VLLM_SUPPORT=1 and ask logprobs=0 or more, or with its own "
                                    "return_sampling_mask; SGLang: return_sampling_mask)")
        return []
    rows = as_list(c.rows, f"{c.label}: sampling mask")
    if len(rows) != n:
        raise EngineOutputError(f"{c.label}: {len(rows)} sampling-mask rows for {n} generated tokens")
    if None in rows:
        raise EngineOutputError(f"{c.label} token {rows.index(None)}: sampling mask row is null")
    if not all(type(r) is list for r in rows):
        rows = [as_list(r, f"{c.label} token {t}: sampling mask") for t, r in enumerate(rows)]
    return rows


def _sort_rows(parsed: _Parsed, row_of: np.ndarray, where):
    """(ids ascending within each row, the permutation applied, whether each row's sampled token was
    found in it and where). Rows and ids are below 2^31 (checked before), so (row, id) packs into one
    int64 key: one argsort instead of a lexsort, ten times faster; per-entry log-probs follow `order`."""
    keys = (row_of << 32) | parsed.ids
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    ids = keys & 0xFFFFFFFF
    dup = np.flatnonzero((row_of[1:] == row_of[:-1]) & (ids[1:] == ids[:-1]))
    if dup.size:
        r = int(row_of[dup[0]])
        raise EngineOutputError(f"{where(r)}: token id {int(ids[dup[0]])} appears twice in its sampling mask")
    found, pos = _find_sampled(keys, parsed.sampled)
    bad = np.flatnonzero(~found & (parsed.counts > 0))
    if bad.size:
        r = int(bad[0])
        raise EngineOutputError(f"{where(r)}: sampled token {int(parsed.sampled[r])} is not in its sampling mask "
                                f"of {int(parsed.counts[r])} ids")
    return ids, order, found, pos


def row_extras(n: int, *, step=None, temperature=None) -> dict:
    """`step` and `temperature` for every row, which engines do not echo in their responses."""
    out = {}
    if step is not None:
        if not _is_int(step):
            raise EngineOutputError(f"step must be an integer, got {step!r}")
        if not -2 ** 63 <= int(step) < 2 ** 63:  # torch.full would raise a bare OverflowError
            raise EngineOutputError(f"step {step} does not fit in a 64-bit integer")
        out["step"] = torch.full((n,), int(step), dtype=torch.int64)
    if temperature is not None:
        if not _is_real(temperature) or not (temperature >= 0 and math.isfinite(temperature)):
            raise EngineOutputError(f"temperature must be a finite number >= 0, got {temperature!r}")
        # stored as float32, like every temperature of a mask: 1e39 would overflow (an error
        # deep in torch) and 1e-46 silently become 0, greedy (params.py names both for capture)
        problem = _float32_problem(float(temperature))
        if problem:
            raise EngineOutputError(f"temperature {temperature!r} {problem} in float32")
        out["temperature"] = torch.full((n,), float(temperature), dtype=torch.float32)
    return out


class _Locator:
    """Global row -> 'request r choice c token t' for error messages."""

    def __init__(self, completions, starts):
        self.completions, self.starts = completions, starts

    def __call__(self, row: int) -> str:
        ci = int(np.searchsorted(self.starts, row, side="right")) - 1
        return f"{self.completions[ci].label} token {row - int(self.starts[ci])}"


def _int_list(values: list, label: str, what: str, counts=None) -> np.ndarray:
    """Strict integer conversion: a float, bool, string or null among ids is an error naming where
    it is (numpy would silently truncate 2.5 to 2 or parse '3')."""
    # set(map(type)) runs at C speed; numpy integer scalars take the slower generic check
    if set(map(type, values)) <= {int} or all(map(_is_int, values)):
        try:
            return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
        except OverflowError:
            pass
    for i, x in enumerate(values):
        if not _is_int(x) or not -2**63 <= int(x) < 2**63:
            if counts is None:
                raise EngineOutputError(f"{label}: {what} {i} is {x!r}, not an integer token id")
            t = int(np.searchsorted(np.cumsum(counts), i, side="right"))
            raise EngineOutputError(f"{label} token {t}: {what} {x!r} is not an integer token id")
    raise AssertionError("unreachable")  # pragma: no cover


def _float_list(values: list, label: str, what: str, unit: str = "token") -> np.ndarray:
    for i, x in enumerate(values):
        if not _is_real(x):
            raise EngineOutputError(f"{label} {unit} {i}: {what} is {x!r}, not a number")
    return _as_float64(values, label, what, unit=unit)


def _as_float64(values: list, label: str, what: str, counts=None, unit: str = "token") -> np.ndarray:
    """Numbers (checked) as float64; a JSON integer beyond a float (10**400) is named by its token
    instead of numpy's bare OverflowError."""
    try:
        return np.array(values, dtype=np.float64) if values else np.zeros(0, dtype=np.float64)
    except OverflowError:
        i = next(i for i, x in enumerate(values) if _is_int(x) and abs(int(x)) >= _F32_TO_INF)
        text = str(values[i])
        text = text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
        raise EngineOutputError(f"{_token_label(label, i, counts, unit)}: {what} {text} {_OUT_OF_RANGE}") from None


# log-probs are stored as float32: a finite value beyond it (-1e300) would silently become -inf
# (probability 0) with numpy's overflow warning; no float32 engine writes one, so it is refused
_OUT_OF_RANGE = "is out of float32 range (log-probs are float32; -inf is probability 0)"


def _token_label(label: str, i: int, counts=None, unit: str = "token") -> str:
    t = i if counts is None else int(np.searchsorted(np.cumsum(counts), i, side="right"))
    return f"{label} {unit} {t}"


def _check_logprobs(values: np.ndarray, label: str, what: str, counts=None, unit: str = "token") -> np.ndarray:
    """An engine's log-probs: a number <= 0 (float32 rounding aside) or -inf; NaN and +inf, or a
    positive value (a probability above 1), is a broken response, named by its token; so is a finite
    value float32 cannot hold."""
    bad = np.flatnonzero(np.isnan(values) | (values > LOGPROB_MARGIN))
    if bad.size:
        i = int(bad[0])
        raise EngineOutputError(f"{_token_label(label, i, counts, unit)}: {what} {float(values[i])!r} is not a "
                                "log-probability (must be <= 0, not NaN)")
    bad = np.flatnonzero(np.isfinite(values) & (values <= -_F32_TO_INF))
    if bad.size:
        i = int(bad[0])
        raise EngineOutputError(f"{_token_label(label, i, counts, unit)}: {what} {float(values[i])!r} {_OUT_OF_RANGE}")
    return values


def checked_logprobs(values: Any, label: str, what: str, unit: str = "token") -> np.ndarray:
    """A flat sequence of log-probs (list, numpy array or tensor) as float64, checked like a JSON
    response's: a non-number, NaN, +inf, a value > 0 or beyond float32 is named by its `unit` index."""
    if isinstance(values, torch.Tensor) and (values.dtype == torch.bool or values.is_complex()):
        raise EngineOutputError(f"{label} {what}: expected numbers, got a {values.dtype} tensor")
    if isinstance(values, (np.ndarray, torch.Tensor)) and values.ndim != 1:
        raise EngineOutputError(f"{label} {what}: expected a 1-D sequence, got shape {tuple(values.shape)}")
    vals = as_list(values, f"{label} {what}")
    return _check_logprobs(_float_list(vals, label, what, unit), label, what, unit=unit)


def _token_logprobs(c: Completion, n: int):
    if c.token_logprobs is None:
        return None
    vals = as_list(c.token_logprobs, f"{c.label}: logprobs")
    if len(vals) != n:
        raise EngineOutputError(f"{c.label}: {len(vals)} log-probs for {n} generated tokens")
    return _check_logprobs(_float_list(vals, c.label, "log-prob"), c.label, "log-prob")


def _entry_logprobs(c: Completion, counts: np.ndarray):
    if c.entry_logprobs is None:
        return None
    lrows = as_list(c.entry_logprobs, f"{c.label}: sampling-mask log-probs")
    if len(lrows) != counts.size:
        raise EngineOutputError(f"{c.label}: {len(lrows)} rows of sampling-mask log-probs for {counts.size} "
                                "sampling-mask rows")
    out = []
    for t, (lr, k) in enumerate(zip(lrows, counts.tolist())):
        lr = as_list(lr, f"{c.label} token {t}: sampling-mask log-probs")
        if len(lr) != k:
            raise EngineOutputError(f"{c.label} token {t}: {len(lr)} sampling-mask log-probs for {k} mask ids")
        out.append(lr)
    flat = list(chain.from_iterable(out))
    for i, x in enumerate(flat):
        if not _is_real(x):
            raise EngineOutputError(f"{_token_label(c.label, i, counts)}: sampling-mask log-prob {x!r} is not a number")
    what = "sampling-mask log-prob"
    return _check_logprobs(_as_float64(flat, c.label, what, counts), c.label, what, counts)


def _check_ids(ids, row_of, sampled, vocab_size, where):
    # int32 ids whatever vocab_size says: a larger one would let 2^32 + 5 through, to wrap to 5 in the cast
    limit = min(vocab_size, INT32_LIMIT) if vocab_size is not None else INT32_LIMIT
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        r = int(row_of[bad[0]])
        raise EngineOutputError(f"{where(r)}: sampling-mask id {int(ids[bad[0]])} is out of range [0, {limit})")
    bad = np.flatnonzero((sampled < 0) | (sampled >= limit))
    if bad.size:
        r = int(bad[0])
        raise EngineOutputError(f"{where(r)}: generated token id {int(sampled[r])} is out of range [0, {limit})")


def _find_sampled(keys, sampled):
    """Per row: is the sampled token in the mask row, and its entry index (keys sorted, packed
    as (row << 32) | id)."""
    want = (np.arange(sampled.size, dtype=np.int64) << 32) | sampled
    pos = np.searchsorted(keys, want)
    found = np.zeros(sampled.size, dtype=bool)
    inside = pos < keys.size
    found[inside] = keys[pos[inside]] == want[inside]
    return found, np.minimum(pos, max(keys.size - 1, 0))


def _row_logprobs(tlp_parts, elp_parts, order, found, pos, n_tok, n_ent, completions):
    """The sampled token's log-prob per row, which engine field(s) it came from, and the per-entry
    log-probs sorted like the ids (float32 [nnz]) when every completion with tokens sent them."""
    have = [t is not None or e is not None for t, e in zip(tlp_parts, elp_parts)]
    if not any(have):
        return None, "none", None
    for i, c in enumerate(completions):
        if n_tok[i] and not have[i]:
            raise EngineOutputError(f"{c.label}: no log-probs, while other completions have them "
                                    "(request log-probs for every completion, or for none)")
    entry_lp = None
    if any(e is not None for e in elp_parts):
        # per-entry values in the engine's order, NaN where a completion sent none; then sorted
        # like the ids
        flat = np.concatenate([e if e is not None else np.full(k, np.nan) for e, k in zip(elp_parts, n_ent)])
        entry_lp = flat[order]
    out = np.full(int(sum(n_tok)), np.nan, dtype=np.float64)
    sources, row = set(), 0
    for i in range(len(completions)):
        sl = slice(row, row + n_tok[i])
        view = out[sl]
        if tlp_parts[i] is not None:
            view[:] = tlp_parts[i]
            sources.add("logprobs")
        if elp_parts[i] is not None:
            # the mask's own log-prob of the sampled id wins: it is normalised over the mask by
            # construction, while per-token log-probs depend on the engine's logprobs mode.
            # Empty rows have no entry and keep the per-token value (or NaN).
            use = found[sl]
            view[use] = entry_lp[pos[sl][use]]
            sources.add("sampling_mask_logprobs")
        row += n_tok[i]
    every = all(e is not None or not n_tok[i] for i, e in enumerate(elp_parts))
    entries = torch.from_numpy(entry_lp.astype(np.float32)) if entry_lp is not None and every else None
    return torch.from_numpy(out.astype(np.float32)), "+".join(sorted(sources)), entries
