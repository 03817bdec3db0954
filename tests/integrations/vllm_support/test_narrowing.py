"""The host's cut of the blocks (integrations/vllm_support/narrowing.py) on vLLM 0.32's LogprobsTensors /
LogprobsLists shapes (fakes.py): the step's ids after `tolists` end at its widest row, a request's after
`slice_request` at its own rows' widest, as column views of the same memory (no copy); every row decodes
as before the cut; lists without blocks pass unchanged; undo() restores the methods."""
import numpy as np
import pytest
import torch

from mask_replay.integrations.vllm_support import _patching, narrowing, wire
from tests.integrations.vllm_support.fakes import LogprobsLists, LogprobsTensors

V = 1000  # 32 words


@pytest.fixture
def patched():
    narrowing.install(LogprobsTensors, LogprobsLists)
    yield
    _patching.undo()


def step_tensors(supports: list, n: int = 1, dtype=torch.int32) -> LogprobsTensors:
    """int32 ids (V1), or int64 (Model Runner V2: two block words a column)."""
    support = torch.zeros(len(supports), V, dtype=torch.bool)
    for r, ids in enumerate(supports):
        support[r, ids] = True
    sampled = torch.tensor([ids[0] if ids else 0 for ids in supports])
    blocks = wire.as_columns(wire.encode(support, sampled), dtype)
    ids = torch.cat([sampled[:, None].repeat(1, n).to(dtype), blocks], 1)
    return LogprobsTensors(ids, torch.zeros(len(supports), n), torch.zeros(len(supports), dtype=torch.int64))


def decoded(lists, n):
    return [r.tolist() for r in wire.decode(lists.logprob_token_ids[:, n:])]


SUPPORTS = [[1, 2, 3], [7], list(range(0, 20)), [5, 9]]


def test_the_step_is_cut_to_its_widest_row_and_each_request_to_its_own(patched):
    tensors = step_tensors(SUPPORTS, n=2)
    full = tensors.logprob_token_ids.numpy()
    step = tensors.tolists()
    assert step.logprob_token_ids.shape == (4, 2 + wire.HEADER + 20)
    assert np.shares_memory(step.logprob_token_ids, full)  # a view of the copied tensor
    assert decoded(step, 2) == SUPPORTS
    widths = [step.slice_request(r, 1).logprob_token_ids.shape[1] for r in range(4)]
    assert widths == [2 + wire.HEADER + len(s) for s in SUPPORTS]
    assert [decoded(step.slice_request(r, 1), 2)[0] for r in range(4)] == SUPPORTS
    pair = step.slice_request(1, 2)  # several positions of one request (a stop-string trim, spec decode)
    assert pair.logprob_token_ids.shape[1] == 2 + wire.HEADER + 20 and decoded(pair, 2) == SUPPORTS[1:3]


def test_int64_ids_are_cut_to_the_columns_their_words_need(patched):
    """MRV2: a row's words two a column, so its columns are half its words, rounded up."""
    step = step_tensors(SUPPORTS, n=2, dtype=torch.int64).tolists()
    assert step.logprob_token_ids.dtype == np.int64
    assert step.logprob_token_ids.shape == (4, 2 + (wire.HEADER + 20 + 1) // 2)
    assert decoded(step, 2) == SUPPORTS
    widths = [step.slice_request(r, 1).logprob_token_ids.shape[1] for r in range(4)]
    assert widths == [2 + (wire.HEADER + len(s) + 1) // 2 for s in SUPPORTS]
    assert [decoded(step.slice_request(r, 1), 2)[0] for r in range(4)] == SUPPORTS


def test_bitmask_and_whole_rows_keep_what_they_need(patched):
    tensors = step_tensors([list(range(0, V, 2)), list(range(V)), [4]])
    step = tensors.tolists()
    assert step.logprob_token_ids.shape[1] == 1 + wire.HEADER + 32  # the bitmask row's 32 words
    assert step.slice_request(1, 1).logprob_token_ids.shape[1] == 1 + wire.HEADER  # the whole vocabulary: no payload
    assert decoded(step.slice_request(0, 1), 1) == [list(range(0, V, 2))]


def test_lists_without_blocks_and_damaged_headers_are_never_widened_or_cut_below_the_header(patched):
    plain = LogprobsTensors(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64))
    assert plain.tolists().logprob_token_ids.shape == (3, 2)
    ids = np.array([[5, V, 40, 1, 2]], np.int32)  # a header announcing 40 ids over 3 columns
    lists = LogprobsLists(ids, np.zeros((1, 1), np.float32), np.zeros(1, np.int64))
    assert lists.slice_request(0, 1).logprob_token_ids.shape == (1, 5)  # left for the decoder to refuse
    short = LogprobsLists(ids[:, :2], np.zeros((1, 1), np.float32), np.zeros(1, np.int64))
    assert short.slice_request(0, 1).logprob_token_ids.shape == (1, 2)


def test_undo_restores_the_methods():
    before = (LogprobsTensors.__dict__["tolists"], LogprobsLists.__dict__["slice_request"])
    narrowing.install(LogprobsTensors, LogprobsLists)
    assert _patching.is_wrapped(LogprobsTensors, "tolists") and _patching.is_wrapped(LogprobsLists, "slice_request")
    _patching.undo()
    assert (LogprobsTensors.__dict__["tolists"], LogprobsLists.__dict__["slice_request"]) == before
