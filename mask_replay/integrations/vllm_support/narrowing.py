"""The host's cut of the support blocks: after the device-to-host copy, the ids keep only the columns
their rows need, as numpy column-slice views (no copy).

The sampler half appends fixed-width blocks (wire.encode: HEADER + ceil(V / 32) columns a row, whatever
the support, so the step never waits for the host). Two wrappers, each following vLLM 0.32.0's
`vllm/v1/outputs.py`, take the width back to what the rows carry:
- `LogprobsTensors.tolists()` (the engine core, on the copied step: V1's `AsyncGPUModelRunnerOutput.
  get_output` and `GPUModelRunner` without async scheduling, the rejection sampler's `parse_output`,
  Model Runner V2's `async_utils`): the step's ids cut to its widest row;
- `LogprobsLists.slice_request(req_idx, num_positions)` (the scheduler's `update_from_output`, one request's
  rows of the step, and the output processor's `_trim_surplus_tokens`): cut to that request's own rows.
msgpack then sends the request's [rows, width] ids (a non-contiguous view is packed by its bytes,
`vllm/v1/serial_utils.py` `_encode_ndarray`), so what crosses the process boundary to the API is each
row's payload (4 bytes an id, or ceil(V / 32) words; on MRV2's int64 ids two words a column) plus the
widest row's padding and the 8-byte header.
Lists whose ids are not wider than their log-probs (no blocks) pass unchanged; a damaged header never
widens anything and is refused by the decoder.
"""
from __future__ import annotations

import numpy as np

from mask_replay.integrations.vllm_support import _patching, wire

_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))  # V1's ids and MRV2's; any other carries no blocks of ours


def install(logprobs_tensors_cls, logprobs_lists_cls) -> None:
    """Wrap whichever of the two methods the release has (both in 0.32 and 0.34): a release without one
    only sends wider rows, never different ones."""
    for cls, name in ((logprobs_tensors_cls, "tolists"), (logprobs_lists_cls, "slice_request")):
        if callable(getattr(cls, name, None)):
            _patching.wrap(cls, name, _narrowing)


def narrowed(lists):
    """`lists` (a LogprobsLists) with its ids cut to the width of the widest block it holds (in columns of
    the ids' dtype: an int64 column holds two of the blocks' int32 words)."""
    ids = lists[0]
    width = lists[1].shape[1]
    if ids.shape[1] <= width or ids.dtype not in _ID_DTYPES:
        return lists
    words = wire.words_of(ids[:, width:])
    spare = words.shape[1] - wire.HEADER  # payload words after the header
    if spare <= 0:
        return lists
    need = wire.HEADER + min(wire.payload_width(words[:, :wire.HEADER]), spare)
    per_column = ids.itemsize // 4
    keep = width + -(-need // per_column)
    if keep == ids.shape[1]:
        return lists
    return lists._make((ids[:, :keep], *lists[1:]))


def _narrowing(original):
    def cut(self, *args, **kwargs):
        return narrowed(original(self, *args, **kwargs))
    return cut
