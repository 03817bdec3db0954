"""The API half: support blocks split off vLLM's log-prob ids and attached to each `CompletionOutput`.

Follows vLLM 0.32.0, `vllm/v1/engine/logprobs.py` and `vllm/v1/engine/output_processor.py`:
- `LogprobsProcessor._update_sample_logprobs(logprobs_lists)` receives one request's new rows (numpy,
  already cut to the tokens kept after a stop string by `_trim_surplus_tokens`). Where the ids are wider
  than the log-probs, the extra columns are the sampler half's blocks: the wrapper appends the ids (as
  they came, with the log-probs' width) to the request's `BlockLog` kept on the processor and hands vLLM a
  view of the ids it always saw. O(1) Python per request and step: nothing is cut or decoded here.
- `RequestState._new_completion_output(token_ids, ...)` builds the `CompletionOutput`; the wrapper sets
  its `sampling_support` to a `LazySupport` of the rows of `token_ids` (all of them, or in DELTA streaming
  the new ones, as vLLM slices the log-probs): an O(1) object with SupportRows' fields that decodes the
  request's blocks (vectorised, every block checked: wire.decode_flat) on its first read and keeps them,
  so a CUMULATIVE stream (AsyncLLM's default, verl's rollout server) costs O(T) per request, and its
  successive outputs are views of one buffer (read them, do not write into them). A damaged block is an
  EngineOutputError naming the request and token, raised where that request's support is read: the
  other requests of the step are unaffected. A completion some of whose tokens came without blocks gets
  `sampling_support = None`: never a support that is not the engine's.
The step's arrays are kept as views until read: vLLM allocates them per step (the sampler's tensors, the
device-to-host copy, msgpack's per-message buffers; Ray's read-only ones it copies itself).
"""
from __future__ import annotations

import inspect

import numpy as np

from mask_replay.errors import EngineOutputError
from mask_replay.integrations.vllm_support import _patching, wire
from mask_replay.sampler.adapters.vllm_support import FIELD, SupportRows

_LOG = "_mask_replay_blocks"  # LogprobsProcessor: the request's BlockLog (None once a token came without)
_MISSING = object()
_INDEXED_WIDTHS = 22  # log-prob widths 1 + N for N up to vLLM's default max_logprobs (20) have a ready index


def install(logprobs_processor_cls, request_state_cls, delta_kind) -> None:
    _patching.wrap(logprobs_processor_cls, "_update_sample_logprobs", _splitting_update)
    _patching.wrap(request_state_cls, "_new_completion_output",
                   lambda original: _attaching_output(original, delta_kind))


class BlockLog:
    """One request's blocks as they came, decoded on demand into one growing CSR buffer. `steps` holds each
    step's whole [rows, columns] id array (int32; MRV2's int64; a view, as vLLM handed it) and `skips` the
    log-probs' width in it: the columns past it are the blocks (columns differ between steps: each is cut to
    its own widest row). The cut is made at decode time, once per request, not in vLLM's output loop.

    Appending never changes what an earlier read handed out: decoded rows are written past the filled
    part, and growing moves to new arrays while old views keep the old ones."""

    __slots__ = ("steps", "skips", "num_rows", "sent", "_decoded", "_ids", "_offsets", "_vocab", "_error")

    def __init__(self):
        self.steps: list[np.ndarray] = []  # not yet decoded (appended by the update wrapper itself)
        self.skips: list[int] = []
        self.num_rows = 0  # rows appended
        self.sent = 0  # rows handed out in DELTA outputs
        self._decoded = 0
        self._ids = np.zeros(0, dtype=np.int32)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._vocab = None
        self._error = None

    def rows(self, start: int, stop: int, request_id) -> SupportRows:
        """Rows [start, stop) (views of the buffer), decoding whatever came since the last read."""
        if stop > self._decoded:
            self._decode(f"request {request_id}")
        lo, hi = int(self._offsets[start]), int(self._offsets[stop])
        offsets = self._offsets[start:stop + 1]
        return SupportRows(self._ids[lo:hi], offsets - lo if lo else offsets, self._vocab)

    def _decode(self, label: str) -> None:
        if self._error is not None:
            raise EngineOutputError(self._error)
        steps, skips, self.steps, self.skips = self.steps, self.skips, [], []
        try:
            blocks = [wire.words_of(s[:, skip:]) for s, skip in zip(steps, skips)]  # int32 words (MRV2: 2 a column)
            values = np.concatenate([b.ravel() for b in blocks])
            widths = np.repeat(np.array([b.shape[1] for b in blocks], dtype=np.int64),
                               [b.shape[0] for b in blocks])
            starts = np.cumsum(widths) - widths
            new = wire.decode_flat(values, starts, widths)
            if self._vocab is not None and new.vocab_size != self._vocab:
                raise wire.BlockError(0, f"vocabulary width {new.vocab_size} in the block header, the request's "
                                         f"first row had {self._vocab}")
        except wire.BlockError as e:
            self._error = f"{label} token {self._decoded + e.row}: {FIELD}: {e.problem}"
            raise EngineOutputError(self._error) from None
        self._vocab = new.vocab_size
        nnz, rows = int(self._offsets[self._decoded]), self._decoded
        need_ids, need_rows = nnz + new.token_ids.size, rows + new.num_rows + 1
        if need_ids > self._ids.size:
            self._ids = _grown(self._ids, need_ids, nnz)
        if need_rows > self._offsets.size:
            self._offsets = _grown(self._offsets, need_rows, rows + 1)
        self._ids[nnz:need_ids] = new.token_ids
        self._offsets[rows + 1:need_rows] = new.offsets[1:] + nnz
        self._decoded = rows + new.num_rows


def _grown(values: np.ndarray, need: int, filled: int) -> np.ndarray:
    grown = np.zeros(max(need, 2 * values.size), dtype=values.dtype)
    grown[:filled] = values[:filled]
    return grown


class LazySupport:
    """Rows [start, stop) of a request's BlockLog with SupportRows' fields (token_ids, offsets, vocab_size,
    num_rows): decoded and checked on the first read of token_ids, offsets or vocab_size, then kept.
    Pickles as the plain SupportRows (Ray, multiprocessing). Made by the output wrapper (`_attaching`),
    which sets the first four slots itself: no __init__ call per output."""

    __slots__ = ("_log", "_start", "_stop", "_request_id", "_rows")

    @property
    def num_rows(self) -> int:
        return self._stop - self._start

    def rows(self) -> SupportRows:
        try:
            return self._rows
        except AttributeError:  # the first read (the slot is left unset at construction: this is per token)
            self._rows = self._log.rows(self._start, self._stop, self._request_id)
            return self._rows

    @property
    def token_ids(self) -> np.ndarray:
        return self.rows().token_ids

    @property
    def offsets(self) -> np.ndarray:
        return self.rows().offsets

    @property
    def vocab_size(self) -> int:
        return self.rows().vocab_size

    def __reduce__(self):
        rows = self.rows()
        return SupportRows, (rows.token_ids.copy(), rows.offsets.copy(), rows.vocab_size)

    def __repr__(self) -> str:
        return f"LazySupport(request {self._request_id}, rows {self._start}..{self._stop})"


def _splitting_update(original):
    # The hot path of the API process, once per request and step (issue 44: <= 1 us a token at B = 256):
    # one unpack, two size reads (the rows are the same, so wider ids have more elements), one view through
    # an index made once per width (numpy's slice-tuple parsing was a fifth of the wrapper), one tuple, three
    # appends; names bound here, not looked up as globals. The blocks are cut off the ids at decode time.
    make_lists, key, missing, new_log = tuple.__new__, _LOG, _MISSING, BlockLog
    whole = slice(None)
    prefix = [(whole, slice(None, width)) for width in range(_INDEXED_WIDTHS)]  # ids[:, :width]

    def _update_sample_logprobs(self, logprobs_lists):
        ids, logprobs, ranks, cu = logprobs_lists  # LogprobsLists' four fields (vLLM unpacks them so too)
        if ids.size > logprobs.size:
            width = logprobs.shape[1]
            log = getattr(self, key, missing)
            if log is missing:
                log = new_log()
                setattr(self, key, log)
            if log is not None:
                log.steps.append(ids)
                log.skips.append(width)
                log.num_rows += len(ids)
            index = prefix[width] if width < _INDEXED_WIDTHS else (whole, slice(None, width))
            logprobs_lists = make_lists(type(logprobs_lists), (ids[index], logprobs, ranks, cu))
        elif len(ids) and getattr(self, key, missing) is not None:
            setattr(self, key, None)  # a token without its support: this completion gets none
        return original(self, logprobs_lists)
    return _update_sample_logprobs


def _attaching_output(original, delta_kind):
    """The wrapper of `_new_completion_output`. vLLM 0.32 and 0.34 declare (self, token_ids, finish_reason,
    stop_reason) and call it positionally: that signature gets a wrapper without *args / **kwargs (their
    packing was a third of the wrapper's cost); any other (some releases add routed_experts) the generic one."""
    attach = _attaching(delta_kind)
    if list(inspect.signature(original).parameters) == ["self", "token_ids", "finish_reason", "stop_reason"]:
        def _new_completion_output(self, token_ids, finish_reason, stop_reason):
            return attach(self, original(self, token_ids, finish_reason, stop_reason))
    else:
        def _new_completion_output(self, token_ids, *args, **kwargs):
            return attach(self, original(self, token_ids, *args, **kwargs))
    return _new_completion_output


def _attaching(delta_kind):
    # once per output (every step when streaming): a LazySupport is made without its __init__ (half the cost)
    new_support, key, field = object.__new__, _LOG, FIELD

    def attach(state, output):
        log = getattr(state.logprobs_processor, key, None)  # (None has no such attribute either)
        support = None
        if log is not None:
            stop = log.num_rows
            start = log.sent if state.output_kind is delta_kind else 0
            if stop and start + len(output.token_ids) == stop:
                support = new_support(LazySupport)
                support._log, support._start, support._stop, support._request_id = log, start, stop, state.request_id
                log.sent = stop
        setattr(output, field, support)
        return output
    return attach
