"""The API half (integrations/vllm_support/outputs.py) on LogprobsProcessor / RequestState shaped like vLLM
0.32's (fakes.py): vLLM's own code sees the ids it always saw, the completion carries one support row per
token (all tokens, or the new ones in DELTA streaming), and a token that came without its blocks leaves
the completion with no support rather than a wrong one."""
import numpy as np
import pytest
import torch

from mask_replay.integrations.vllm_support import _patching, outputs, wire
from tests.integrations.vllm_support.fakes import LogprobsLists, OutputKind, output_classes

V = 64


@pytest.fixture
def classes():
    processor_cls, state_cls = output_classes()
    outputs.install(processor_cls, state_cls, OutputKind.DELTA)
    yield processor_cls, state_cls
    _patching.undo()


def step(state, support_ids, sampled, n=0, with_blocks=True):
    """One engine step for one request: vLLM's N + 1 columns, then (optionally) the plugin's blocks."""
    support = torch.zeros(1, V, dtype=torch.bool)
    support[0, support_ids] = True
    ids = np.array([[sampled] + list(range(n))], dtype=np.int32)
    lps = np.full((1, n + 1), -1.5, dtype=np.float32)
    if with_blocks:
        ids = np.concatenate([ids, wire.encode(support, torch.tensor([sampled])).numpy()], axis=1)
    state.tokens.append(sampled)
    state.logprobs_processor._update_sample_logprobs(LogprobsLists(ids, lps, np.zeros(1, np.int64)))


def rows_of(support):
    return [support.token_ids[a:b].tolist() for a, b in zip(support.offsets[:-1], support.offsets[1:])]


def test_final_output_carries_a_row_per_token_and_vllm_sees_its_own_columns(classes):
    _, state_cls = classes
    state = state_cls()
    step(state, [1, 3, 9], 3, n=2)
    step(state, [4], 4, n=2)
    out = state._new_completion_output(None, "stop", None)
    assert rows_of(out.sampling_support) == [[1, 3, 9], [4]] and out.sampling_support.vocab_size == V
    assert state.logprobs_processor.seen_ids == [[3, 0, 1], [4, 0, 1]]  # no block column reached vLLM's loop


def test_delta_outputs_carry_the_new_rows_only(classes):
    _, state_cls = classes
    state = state_cls(OutputKind.DELTA)
    step(state, [1, 2], 2)
    first = state._new_completion_output([2], None, None)
    step(state, [5, 6, 7], 7)
    step(state, [0], 0)
    second = state._new_completion_output([7, 0], None, None)
    assert rows_of(first.sampling_support) == [[1, 2]]
    assert rows_of(second.sampling_support) == [[5, 6, 7], [0]]


def test_a_token_without_blocks_leaves_no_support(classes):
    _, state_cls = classes
    state = state_cls()
    step(state, [1, 2], 2)
    step(state, [3], 3, with_blocks=False)
    step(state, [4], 4)
    assert state._new_completion_output(None, "length", None).sampling_support is None


def test_requests_without_logprobs_get_no_support(classes):
    _, state_cls = classes
    state = state_cls()
    state.tokens.extend([5, 6])  # tokens, but no log-prob rows: the request asked for none
    assert state._new_completion_output(None, "length", None).sampling_support is None


def test_rows_that_disagree_with_the_tokens_are_not_attached(classes):
    _, state_cls = classes
    state = state_cls()
    step(state, [1, 2], 2)
    state.tokens.append(9)  # a token whose row never came
    assert state._new_completion_output(None, "length", None).sampling_support is None


def test_split_leaves_plain_lists_alone():
    lists = LogprobsLists(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32), np.zeros(2, np.int64))
    plain, blocks = outputs.split(lists)
    assert plain is lists and blocks is None


def test_cumulative_outputs_carry_all_rows_so_far_without_rejoining(classes):
    # AsyncLLM streaming (verl's rollout server) builds a completion at every step with all tokens so far
    _, state_cls = classes
    state = state_cls(OutputKind.CUMULATIVE)
    seen = []
    for t in range(40):
        step(state, [t % V, (t + 7) % V], t % V)
        seen.append(state._new_completion_output(None, None, None).sampling_support)
    for t, support in enumerate(seen):
        assert rows_of(support) == [sorted({s % V, (s + 7) % V}) for s in range(t + 1)]
    assert np.shares_memory(seen[-2].token_ids, seen[-1].token_ids)  # views of one buffer, not joined anew
