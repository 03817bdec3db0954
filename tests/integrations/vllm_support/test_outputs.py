"""The API half (integrations/vllm_support/outputs.py) on LogprobsProcessor / RequestState shaped like vLLM
0.32's (fakes.py): vLLM's own code sees the ids it always saw, the completion carries one support row per
token (all tokens, or the new ones in DELTA streaming), decoded lazily on the first read; a token that
came without its blocks leaves the completion with no support rather than a wrong one; a damaged block is
an EngineOutputError naming the request and token when that request's support is read, and no other
request notices."""
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mask_replay.errors import EngineOutputError
from mask_replay.integrations.vllm_support import _patching, outputs, wire
from mask_replay.sampler.adapters.vllm_support import SupportRows, support_rows, support_to_json
from tests.integrations.vllm_support.fakes import LogprobsLists, OutputKind, output_classes

V = 64


@pytest.fixture
def classes():
    processor_cls, state_cls = output_classes()
    outputs.install(processor_cls, state_cls, OutputKind.DELTA)
    yield processor_cls, state_cls
    _patching.undo()


def lists(ids: np.ndarray, n: int) -> LogprobsLists:
    return LogprobsLists(ids, np.full((ids.shape[0], n + 1), -1.5, np.float32), np.zeros(ids.shape[0], np.int64))


def step(state, support_ids, sampled, n=0, with_blocks=True, narrow=True, vocab=V):
    """One engine step for one request: vLLM's N + 1 columns, then (optionally) the plugin's blocks, cut to
    the row's width as the engine core's narrowing does (or left at the fixed width)."""
    support = torch.zeros(1, vocab, dtype=torch.bool)
    support[0, support_ids] = True
    ids = np.array([[sampled] + list(range(n))], dtype=np.int32)
    if with_blocks:
        blocks = wire.encode(support, torch.tensor([sampled])).numpy()
        if narrow:
            blocks = blocks[:, :wire.HEADER + wire.payload_width(blocks[:, :2])]
        ids = np.concatenate([ids, blocks], axis=1)
    state.tokens.append(sampled)
    state.logprobs_processor._update_sample_logprobs(lists(ids, n))


def rows_of(support):
    return [support.token_ids[a:b].tolist() for a, b in zip(support.offsets[:-1], support.offsets[1:])]


def test_final_output_carries_a_row_per_token_and_vllm_sees_its_own_columns(classes):
    _, state_cls = classes
    state = state_cls()
    step(state, [1, 3, 9], 3, n=2)
    step(state, [4], 4, n=2, narrow=False)
    out = state._new_completion_output(None, "stop", None)
    assert out.sampling_support.num_rows == 2
    assert rows_of(out.sampling_support) == [[1, 3, 9], [4]] and out.sampling_support.vocab_size == V
    assert state.logprobs_processor.seen_ids == [[3, 0, 1], [4, 0, 1]]  # no block column reached vLLM's loop


def test_a_release_with_another_signature_gets_the_generic_wrapper():
    """Releases that add `routed_experts` (a fourth argument, positional or by name) keep it: the fast wrapper
    is for vLLM 0.32 / 0.34's exact (token_ids, finish_reason, stop_reason) only."""
    processor_cls, state_cls = output_classes()
    three = state_cls._new_completion_output

    def with_experts(self, token_ids, finish_reason, stop_reason, routed_experts=None):
        out = three(self, token_ids, finish_reason, stop_reason)
        out.routed = routed_experts
        return out

    state_cls._new_completion_output = with_experts
    outputs.install(processor_cls, state_cls, OutputKind.DELTA)
    try:
        for call in (lambda s: s._new_completion_output(None, "stop", None, "experts"),
                     lambda s: s._new_completion_output(None, "stop", None, routed_experts="experts")):
            state = state_cls()
            step(state, [2, 5], 5)
            out = call(state)
            assert out.routed == "experts" and rows_of(out.sampling_support) == [[2, 5]]
    finally:
        _patching.undo()
    assert state_cls._new_completion_output is with_experts


def test_nothing_is_decoded_before_the_support_is_read(classes, monkeypatch):
    _, state_cls = classes
    state = state_cls()
    calls = []
    decode = wire.decode_flat
    monkeypatch.setattr(wire, "decode_flat", lambda *a: calls.append(1) or decode(*a))
    for t in range(5):
        step(state, [t, t + 1], t)
    out = state._new_completion_output(None, "stop", None)
    assert calls == [] and out.sampling_support.num_rows == 5  # the row count needs no decode
    assert rows_of(out.sampling_support) == [[t, t + 1] for t in range(5)]
    assert calls == [1]  # all five steps in one pass
    rows_of(out.sampling_support)
    assert calls == [1]  # and kept


def test_delta_outputs_carry_the_new_rows_only(classes):
    _, state_cls = classes
    state = state_cls(OutputKind.DELTA)
    step(state, [1, 2], 2)
    first = state._new_completion_output([2], None, None)
    step(state, [5, 6, 7], 7)
    step(state, [0], 0)
    second = state._new_completion_output([7, 0], None, None)
    assert rows_of(second.sampling_support) == [[5, 6, 7], [0]]
    assert rows_of(first.sampling_support) == [[1, 2]]  # read after later steps: still its own row


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


def test_lists_without_blocks_reach_vllm_untouched():
    processor_cls, state_cls = output_classes()
    seen = []
    processor_cls._update_sample_logprobs = lambda self, logprobs_lists: seen.append(logprobs_lists)
    outputs.install(processor_cls, state_cls, OutputKind.DELTA)
    try:
        plain_lists = lists(np.zeros((2, 3), np.int32), 2)
        processor_cls()._update_sample_logprobs(plain_lists)
    finally:
        _patching.undo()
    assert seen == [plain_lists] and seen[0] is plain_lists


def test_cumulative_outputs_carry_all_rows_so_far_without_rejoining(classes):
    # AsyncLLM streaming (verl's rollout server) builds a completion at every step with all tokens so far
    _, state_cls = classes
    state = state_cls(OutputKind.CUMULATIVE)
    seen = []
    for t in range(40):
        step(state, [t % V, (t + 7) % V], t % V)
        seen.append(state._new_completion_output(None, None, None).sampling_support)
        if t % 9 == 0:
            rows_of(seen[-1])  # some read as they come, the rest later
    for t, support in enumerate(seen):
        assert rows_of(support) == [sorted({s % V, (s + 7) % V}) for s in range(t + 1)]
    assert np.shares_memory(seen[-2].token_ids, seen[-1].token_ids)  # views of one buffer, not joined anew


def damaged_step(state, block, n=0):
    ids = np.concatenate([np.array([[int(block[-1]) if len(block) > 2 else 0]], np.int32),
                          np.array([block], np.int32)], axis=1)
    state.tokens.append(0)
    state.logprobs_processor._update_sample_logprobs(lists(ids[:, :1 + len(block)], n))


@pytest.mark.parametrize("block, problem", [
    ([V, wire.BITMASK, 3], "a bitmask of 1 words, its header announces 2"),  # issue 48 item 1
    ([40, wire.BITMASK, 3, 0b11 << 8], "bits set at ids >= its vocabulary width 40"),  # item 2
    ([V], "1 columns, fewer than the 2 of the header"),  # item 3: one column past the log-probs
    ([V, 3, 2, 9], "header 3 for 2 payload columns"),
    ([V, 2, 9, 2], "not strictly ascending"),
    ([V, 1, 70], r"id 70 is outside \[0, 64\)"),
    ([V, -5, 1], "header -5"),
])
def test_a_damaged_block_fails_its_request_only_when_read(classes, block, problem):
    _, state_cls = classes
    bad, good = state_cls(request_id="cmpl-7"), state_cls(request_id="cmpl-8")
    first_vocab = block[0] if block[0] > 0 else V  # the rows before it agree on V (that is checked below)
    step(bad, [1, 2], 2, vocab=first_vocab)
    step(good, [1, 2], 2)
    damaged_step(bad, block)  # token 1 of cmpl-7
    step(bad, [4], 4, vocab=first_vocab)
    step(good, [4], 4)
    bad_out = bad._new_completion_output(None, "stop", None)  # nothing raised while the engine streams
    good_out = good._new_completion_output(None, "stop", None)
    with pytest.raises(EngineOutputError, match=f"request cmpl-7 token 1: sampling_support: .*{problem}"):
        bad_out.sampling_support.token_ids
    with pytest.raises(EngineOutputError, match="request cmpl-7 token 1"):
        support_rows(bad_out.sampling_support, "completion 0")  # every later read: the same error
    assert rows_of(good_out.sampling_support) == [[1, 2], [4]]


def test_rows_of_one_request_must_agree_on_the_vocabulary(classes):
    _, state_cls = classes
    state = state_cls(OutputKind.DELTA, request_id="r9")
    step(state, [1, 2], 2)
    first = state._new_completion_output([2], None, None)
    assert rows_of(first.sampling_support) == [[1, 2]]  # decoded before the bad row came
    step(state, [3], 3, vocab=V + 1)
    second = state._new_completion_output([3], None, None)
    with pytest.raises(EngineOutputError, match="request r9 token 1: .*width 65 .* first row had 64"):
        second.sampling_support.offsets


def test_consumers_read_the_lazy_support_as_a_support_rows(classes):
    _, state_cls = classes
    state = state_cls()
    step(state, [1, 3, 9], 3)
    step(state, list(range(V)), 5)
    step(state, list(range(0, V, 2)), 6)  # 32 ids > 2 words: the bitmask
    lazy = state._new_completion_output(None, "stop", None).sampling_support
    checked = support_rows(lazy, "completion 0")
    assert rows_of(checked) == [[1, 3, 9], list(range(V)), list(range(0, V, 2))] and checked.vocab_size == V
    assert support_to_json(lazy) == support_to_json(checked)
    copy = pickle.loads(pickle.dumps(lazy))
    assert isinstance(copy, SupportRows) and rows_of(copy) == rows_of(checked)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 3), st.sampled_from([0.0, 0.03, 0.3, 1.0]), st.integers(0, 2**31 - 1)),
                      min_size=1, max_size=10), kind=st.sampled_from(list(OutputKind)), vocab=st.integers(1, 90),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_streams_round_trip_through_the_api_half(steps, kind, vocab, dtype):
    # several tokens a step (a stop string's trim, speculative-like), narrowed per step, every output kind;
    # int32 ids (V1) and int64 (MRV2: two block words a column)
    processor_cls, state_cls = output_classes()
    outputs.install(processor_cls, state_cls, OutputKind.DELTA)
    try:
        state, expected, handed = state_cls(kind), [], []
        for rows, density, seed in steps:
            g = torch.Generator().manual_seed(seed)
            support = torch.rand(rows, vocab, generator=g) < density
            sampled = torch.randint(0, vocab, (rows,), generator=g)
            blocks = wire.encode(support, sampled)
            blocks = wire.as_columns(blocks[:, :wire.HEADER + wire.payload_width(blocks[:, :2].numpy())], dtype)
            ids = torch.cat([sampled.to(dtype)[:, None], blocks], dim=1).numpy()
            state.tokens.extend(sampled.tolist())
            state.logprobs_processor._update_sample_logprobs(lists(ids, 0))
            new = [torch.nonzero(r)[:, 0].tolist() for r in support]
            expected.extend(new)
            out = state._new_completion_output(sampled.tolist(), None, None)
            handed.append((out.sampling_support, new if kind == OutputKind.DELTA else list(expected)))
        for support, rows in handed:
            assert rows_of(support) == rows and support.vocab_size == vocab
    finally:
        _patching.undo()
