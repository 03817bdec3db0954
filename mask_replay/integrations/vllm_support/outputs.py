"""The API half: support blocks split off vLLM's log-prob ids and attached to each `CompletionOutput`.

Follows vLLM 0.32.0, `vllm/v1/engine/logprobs.py` and `vllm/v1/engine/output_processor.py`:
- `LogprobsProcessor._update_sample_logprobs(logprobs_lists)` receives one request's new rows (numpy,
  already cut to the tokens kept after a stop string by `_trim_surplus_tokens`). Where the ids are wider
  than the log-probs, the extra columns are the sampler half's blocks: they are decoded and appended to
  the request's `wire.RowBuffer` kept on the processor, and vLLM's own code sees the ids it always saw.
- `RequestState._new_completion_output(token_ids, ...)` builds the `CompletionOutput`; the wrapper sets
  its `sampling_support` (a `SupportRows`, one row per token of `token_ids`: all of them, or in
  DELTA streaming the new ones, as vLLM slices the log-probs); all-rows supports are views of the buffer,
  so CUMULATIVE streaming (AsyncLLM's default, verl's rollout server) costs O(T) per request, not O(T^2),
  and its successive outputs share memory (read them, do not write into them). A completion some of whose tokens came
  without blocks gets `sampling_support = None`: never a support that is not the engine's.
"""
from __future__ import annotations

from mask_replay.integrations.vllm_support import _patching, wire
from mask_replay.sampler.adapters.vllm_support import FIELD

_ROWS = "_mask_replay_rows"  # LogprobsProcessor: a wire.RowBuffer of the rows so far (None once a token came without)
_MISSING = object()
_SENT = "_mask_replay_sent"  # rows already handed out (DELTA outputs)


def install(logprobs_processor_cls, request_state_cls, delta_kind) -> None:
    _patching.wrap(logprobs_processor_cls, "_update_sample_logprobs", _splitting_update)
    _patching.wrap(request_state_cls, "_new_completion_output",
                   lambda original: _attaching_output(original, delta_kind))


def split(logprobs_lists):
    """(vLLM's own lists, the support blocks or None): the ids past the log-probs' width are blocks."""
    ids, logprobs = logprobs_lists.logprob_token_ids, logprobs_lists.logprobs
    width = logprobs.shape[1]
    if ids.shape[1] <= width:
        return logprobs_lists, None
    return logprobs_lists._replace(logprob_token_ids=ids[:, :width]), ids[:, width:]


def _splitting_update(original):
    def _update_sample_logprobs(self, logprobs_lists):
        plain, blocks = split(logprobs_lists)
        rows = getattr(self, _ROWS, _MISSING)
        if rows is not None and blocks is None:
            rows = None  # a token without its support: this completion gets none
        elif rows is not None and blocks.shape[0]:
            if rows is _MISSING:
                rows = wire.RowBuffer(int(blocks[0, 0]))
            rows.extend(wire.decode(blocks))
        if rows is not _MISSING:
            setattr(self, _ROWS, rows)
        return original(self, plain)
    return _update_sample_logprobs


def _attaching_output(original, delta_kind):
    def _new_completion_output(self, token_ids, *args, **kwargs):
        output = original(self, token_ids, *args, **kwargs)
        processor = self.logprobs_processor
        rows = getattr(processor, _ROWS, None) if processor is not None else None
        support = None
        if rows is not None and rows.num_rows:
            if self.output_kind == delta_kind:
                sent = getattr(processor, _SENT, 0)
                new = len(output.token_ids)
                if sent + new == rows.num_rows:
                    support = rows.rows(sent)
                    setattr(processor, _SENT, sent + new)
            elif len(output.token_ids) == rows.num_rows:
                support = rows.rows()  # views of the request's buffer: CUMULATIVE outputs cost O(new rows)
        setattr(output, FIELD, support)
        return output
    return _new_completion_output
