"""Engine output adapters (vLLM, SGLang), padded layouts and `mask-replay convert`, against plain
Python references built from the hand-written fixtures in tests/fixtures/."""
import array
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mask_replay import SamplingMask, mask_from_trl_vllm, mask_from_vllm_logprobs
from mask_replay.errors import EngineOutputError
from mask_replay.integrations.vllm_support import wire
from mask_replay.sampler.adapters.vllm_support import support_to_json
from tests.helpers import FIXTURES, assert_clean, assert_one_line_error, fixture, run


# ---- independent references ---------------------------------------------------------------------
def reference_vllm(responses):
    """Rows, sampled, log-probs, sequence, position by plain iteration over the JSON."""
    rows, sampled, lps, seq, pos = [], [], [], [], []
    s = 0
    for resp in responses:
        for ch in sorted(resp["choices"], key=lambda c: c["index"]):
            content = (ch.get("logprobs") or {}).get("content") or []
            mlp = ch.get("sampling_mask_logprobs")
            for t, tok in enumerate(ch["token_ids"]):
                m = ch["sampling_mask"][t]
                rows.append(sorted(m))
                sampled.append(tok)
                if mlp is not None and tok in m:
                    lps.append(mlp[t][m.index(tok)])
                else:
                    lps.append(content[t]["logprob"])
                seq.append(s)
                pos.append(t)
            s += 1
    return rows, sampled, lps, seq, pos


def assert_mask(mask, rows, sampled, lps, seq, pos):
    assert mask.to_lists() == rows
    assert mask.sampled.tolist() == sampled
    assert mask.token_ids.dtype == torch.int32 and mask.offsets.dtype == torch.int64
    np.testing.assert_allclose(mask.logprobs.numpy(), np.array(lps, dtype=np.float32), rtol=0, atol=0)
    assert mask.extras["sequence"].tolist() == seq
    assert mask.extras["position"].tolist() == pos
    mask.validate()


# ---- vLLM ---------------------------------------------------------------------------------------
def test_vllm_generate_json_fixture():
    responses = fixture("vllm_generate.json")
    mask = SamplingMask.from_vllm(responses)
    # req-a choice 0 (3 tokens), choice 1 (2 tokens), req-b none (aborted, no tokens), req-c 1 token
    assert mask.num_rows == 6
    # `sequence` indexes metadata["sequences"], so the empty completion keeps its number (2)
    assert_mask(mask, *reference_vllm(responses))
    # the empty row (token 2 of req-a choice 0) is unsampled: kept, with the per-token log-prob
    assert mask.lengths().tolist() == [2, 4, 0, 3, 1, 2]
    assert mask.logprobs[2].item() == -0.125
    # req-c: the mask's own log-prob of the sampled id wins over the per-token value (-0.75)
    assert mask.logprobs[5].item() == pytest.approx(-0.6931)
    assert mask.metadata["engine"] == "vllm"
    assert mask.metadata["sequences"] == [["req-a", 0], ["req-a", 1], ["req-b", 0], ["req-c", 0]]
    assert "temperature" not in mask.extras and "step" not in mask.extras


def test_vllm_temperature_step_and_vocab():
    mask = SamplingMask.from_vllm(fixture("vllm_generate.json"), temperature=0.7, step=5, vocab_size=12)
    assert mask.extras["temperature"].tolist() == pytest.approx([0.7] * 6)
    assert mask.extras["step"].tolist() == [5] * 6
    assert mask.metadata["vocab_size"] == 12
    with pytest.raises(EngineOutputError,
                       match=r"request 0 \(id 'req-a'\) choice 0 token 1: sampling-mask id 11 .*\[0, 11\)"):
        SamplingMask.from_vllm(fixture("vllm_generate.json"), vocab_size=11)


@dataclass
class Logprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class VllmSamplingMask:  # the shape of vllm.outputs.SamplingMask
    token_ids: list
    logprobs: Optional[list] = None


def as_objects(responses, mask_as_object=True):
    """The fixture as vLLM's offline objects: RequestOutput(outputs=[CompletionOutput...])."""
    out = []
    for resp in responses:
        comps = []
        for ch in resp["choices"]:
            content = (ch.get("logprobs") or {}).get("content") or []
            lp = [{tok: Logprob(e["logprob"], rank=1), 99999: Logprob(-20.0)}
                  for tok, e in zip(ch["token_ids"], content)]
            m = ch["sampling_mask"]
            if m is not None and mask_as_object:
                m = VllmSamplingMask(m, ch.get("sampling_mask_logprobs"))
            comps.append(SimpleNamespace(index=ch["index"], text="", token_ids=array.array("l", ch["token_ids"]),
                                         cumulative_logprob=None, logprobs=lp, sampling_mask=m,
                                         finish_reason=ch["finish_reason"]))
        out.append(SimpleNamespace(request_id=resp["request_id"], prompt=None, prompt_token_ids=[1, 2],
                                   outputs=comps, finished=True))
    return out


def test_vllm_objects_match_json():
    responses = fixture("vllm_generate.json")
    from_json = SamplingMask.from_vllm(responses)
    from_objects = SamplingMask.from_vllm(as_objects(responses))
    assert from_objects == from_json
    assert from_objects.metadata["sequences"] == from_json.metadata["sequences"]
    # sampling_mask as a plain list of id lists: same rows; log-probs then come from `.logprobs`
    plain = SamplingMask.from_vllm(as_objects(responses, mask_as_object=False))
    assert plain.to_lists() == from_json.to_lists()
    assert plain.logprobs[5].item() == -0.75
    # one RequestOutput, and one bare CompletionOutput, are accepted alone
    one = SamplingMask.from_vllm(as_objects(responses)[2])
    assert one.to_lists() == [[6, 10]] and one.extras["sequence"].tolist() == [0]
    bare = SamplingMask.from_vllm(as_objects(responses)[0].outputs[0])
    assert bare.to_lists() == [[2, 7, 9], [3]]


def test_vllm_multi_sample_order_follows_index():
    # n = 3 returned out of order: rows follow the choices' index, then tokens
    choices = [{"index": i, "token_ids": [i, i], "sampling_mask": [[i, 20], [i]]} for i in (2, 0, 1)]
    mask = SamplingMask.from_vllm({"request_id": "x", "choices": choices})
    assert mask.sampled.tolist() == [0, 0, 1, 1, 2, 2]
    assert mask.extras["sequence"].tolist() == [0, 0, 1, 1, 2, 2]
    assert mask.extras["position"].tolist() == [0, 1] * 3
    assert mask.logprobs is None  # no log-probs anywhere: none recorded


def test_vllm_no_completion_and_empty_inputs():
    for empty in ([], {"request_id": "p", "choices": []},
                  {"choices": [{"index": 0, "token_ids": [], "sampling_mask": None}]},
                  SimpleNamespace(request_id="q", outputs=[])):
        mask = SamplingMask.from_vllm(empty)
        assert mask.num_rows == 0 and mask.nnz == 0
        mask.validate()
        ids, counts = mask.to_padded()
        assert ids.shape == (0, 0) and counts.shape == (0,)


def _broken(edit):
    responses = fixture("vllm_generate.json")
    edit(responses)
    return responses


def c1(r):  # request req-a, listed first: the choice with index 1 (tokens [7, 3])
    return r[0]["choices"][0]


def c0(r):  # request req-a, listed second: the choice with index 0 (tokens [4, 11, 2])
    return r[0]["choices"][1]


A = r"request 0 \(id 'req-a'\) "
C = r"request 2 \(id 'req-c'\) choice 0"


@pytest.mark.parametrize("edit, message", [
    (lambda r: c0(r)["sampling_mask"].pop(), A + r"choice 0: 2 sampling-mask rows for 3 generated tokens"),
    (lambda r: c0(r).update(sampling_mask=None), A + r"choice 0: no sampling mask for its 3 generated tokens"),
    (lambda r: c1(r)["sampling_mask"][0].remove(7),
     A + r"choice 1 token 0: sampled token 7 is not in its sampling mask of 2"),
    (lambda r: c1(r)["sampling_mask"][0].append(9), A + r"choice 1 token 0: token id 9 appears twice"),
    (lambda r: c1(r)["sampling_mask"][1].append(-3), A + r"choice 1 token 1: sampling-mask id -3 is out of range"),
    (lambda r: c1(r)["sampling_mask"][1].append(2.5), A + r"choice 1 token 1: mask entry 2.5 is not an integer"),
    (lambda r: c0(r)["sampling_mask"][0].append(True), A + r"choice 0 token 0: mask entry True is not an integer"),
    (lambda r: c0(r)["sampling_mask"][1].append("5"), A + r"choice 0 token 1: mask entry '5' is not an integer"),
    (lambda r: c0(r)["sampling_mask"].__setitem__(1, None), A + r"choice 0 token 1: sampling mask row is null"),
    (lambda r: c0(r)["token_ids"].__setitem__(0, None), A + r"choice 0: token_ids: token 0 is None"),
    (lambda r: c0(r)["token_ids"].__setitem__(0, 2**33),
     A + r"choice 0 token 0: generated token id 8589934592 is out of range"),
    (lambda r: c0(r).update(index=1), A[:-1] + r": two choices have index 1"),
    (lambda r: c0(r).update(index="0"), A + r"choice at position 1: index '0' is not an integer"),
    (lambda r: c0(r)["logprobs"]["content"][1].pop("logprob"),
     A + r"choice 0 token 1: logprobs.content entry has no 'logprob'"),
    (lambda r: c0(r)["logprobs"]["content"].pop(), A + r"choice 0: 2 log-probs for 3 generated tokens"),
    (lambda r: c0(r)["logprobs"]["content"][0].update(logprob="x"),
     A + r"choice 0 token 0: log-prob is 'x', not a number"),
    (lambda r: c1(r).update(logprobs=None), A + r"choice 1: no log-probs, while other completions have them"),
    (lambda r: c1(r).update(logprobs={"foo": 1}), A + r"choice 1: logprobs has neither 'content' nor 'token_logprobs'"),
    (lambda r: c1(r).update(sampling_mask={"ids": []}),
     A + r"choice 1: sampling_mask is a dict, expected a list of id lists"),
    (lambda r: r[2]["choices"][0]["sampling_mask_logprobs"][0].pop(),
     C + r" token 0: 1 sampling-mask log-probs for 2 mask ids"),
    (lambda r: r[2]["choices"][0]["sampling_mask_logprobs"].append([0.0]),
     C + r": 2 rows of sampling-mask log-probs for 1"),
    (lambda r: r[2]["choices"][0]["sampling_mask_logprobs"][0].__setitem__(1, None),
     C + r" token 0: sampling-mask log-prob None is not a number"),
    (lambda r: r.append({"id": "not a response"}), r"request 3: neither a vLLM RequestOutput"),
    (lambda r: r[1].update(choices="abc"), r"request 1 \(id 'req-b'\): choices: expected a list, got str"),
])
def test_vllm_malformed_inputs_are_named(edit, message):
    with pytest.raises(EngineOutputError, match=message):
        SamplingMask.from_vllm(_broken(edit))


def test_vllm_bad_arguments():
    with pytest.raises(EngineOutputError, match="temperature must be a finite number >= 0"):
        SamplingMask.from_vllm(fixture("vllm_generate.json"), temperature=-1.0)
    with pytest.raises(EngineOutputError, match="step must be an integer"):
        SamplingMask.from_vllm(fixture("vllm_generate.json"), step=1.5)
    with pytest.raises(EngineOutputError, match="vocab_size must be a positive integer"):
        SamplingMask.from_vllm(fixture("vllm_generate.json"), vocab_size=0)


def test_vllm_offline_logprobs_without_the_sampled_token_is_an_error():
    objs = as_objects(fixture("vllm_generate.json"))
    del objs[0].outputs[0].logprobs[1][3]
    with pytest.raises(EngineOutputError, match=r"choice 1 token 1: logprobs hold no entry for the generated token 3"):
        SamplingMask.from_vllm(objs)


row_lists = st.lists(st.lists(st.integers(0, 60), min_size=0, max_size=8, unique=True), min_size=0, max_size=12)


@given(rows=row_lists, data=st.data())
def test_vllm_random_rows_match_reference(rows, data):
    tokens = [data.draw(st.sampled_from(r)) if r else data.draw(st.integers(0, 60)) for r in rows]
    # each row's entries a distribution over its mask (the adapter checks that they normalise)
    mlp = [torch.log_softmax(-torch.arange(1.0, len(r) + 1, dtype=torch.float64), 0).tolist() for r in rows]
    content = [{"logprob": -0.5 - t} for t in range(len(rows))]
    choice = {"index": 0, "token_ids": tokens, "sampling_mask": [list(r) for r in rows],
              "sampling_mask_logprobs": mlp, "logprobs": {"content": content}}
    resp = {"request_id": "h", "choices": [choice]}
    mask = SamplingMask.from_vllm(resp)
    assert_mask(mask, *reference_vllm([resp]))


# ---- SGLang -------------------------------------------------------------------------------------
def test_sglang_generate_fixture():
    responses = fixture("sglang_generate.json")
    mask = SamplingMask.from_sglang(responses)
    assert mask.to_lists() == [[3, 12, 30], [5], [8, 9], [2, 4, 9], [1]]
    assert mask.sampled.tolist() == [12, 5, 8, 9, 1]
    # per-token log-probs (response 0), per-support log-probs picked at the sampled id (response 1)
    assert mask.logprobs.tolist() == pytest.approx([-0.4, 0.0, -0.4, -0.2, 0.0])
    assert mask.extras["sequence"].tolist() == [0, 0, 1, 1, 1]
    assert mask.extras["position"].tolist() == [0, 1, 0, 1, 2]
    assert mask.metadata["sequences"] == [["sg-0"], ["sg-1"], ["sg-2"]]
    assert mask.metadata["engine"] == "sglang"


def test_sglang_chat_completion_fixture():
    mask = SamplingMask.from_sglang(fixture("sglang_chat.json"))
    # token ids come from output_token_logprobs entries (logprob, id, text)
    assert mask.to_lists() == [[14, 15], [2]]
    assert mask.sampled.tolist() == [14, 2]
    assert mask.logprobs.tolist() == pytest.approx([-0.3, 0.0])
    assert mask.metadata["sequences"] == [["sg-chat", 0]]


@pytest.mark.parametrize("edit, message", [
    (lambda r: r[0]["meta_info"]["output_token_sampling_mask"].pop(),
     r"response 0 \(id 'sg-0'\): 1 sampling-mask rows for 2"),
    (lambda r: r[1]["meta_info"].pop("output_token_sampling_mask"),
     r"response 1 \(id 'sg-1'\): no sampling mask for its 3"),
    (lambda r: r[0]["meta_info"]["output_token_sampling_mask"][0].remove(12),
     r"response 0 \(id 'sg-0'\) token 0: sampled token 12 is not in its sampling mask of 2"),
    (lambda r: r[1]["meta_info"]["output_token_sampling_logprobs"][1].pop(),
     r"sg-1'\) token 1: 2 sampling-mask log-probs for 3 mask ids"),
    (lambda r: r[0].pop("output_ids"), r"response 0 \(id 'sg-0'\): no output_ids to go with its sampling masks"),
    (lambda r: r.append([1, 2]), r"response 3: not an SGLang response"),
    (lambda r: r[0].pop("meta_info"), r"response 0: not an SGLang response"),
])
def test_sglang_malformed_inputs_are_named(edit, message):
    responses = fixture("sglang_generate.json")
    edit(responses)
    with pytest.raises(EngineOutputError, match=message):
        SamplingMask.from_sglang(responses)


def test_sglang_fixed_capacity_form():
    # capacity 4; slots past each length hold whatever the engine left there (not read)
    fixed = SimpleNamespace(
        token_ids=torch.tensor([[7, 2, 5, 123456], [4, 0, 0, 0], [9, 9, 9, 9]], dtype=torch.int32),
        lengths=torch.tensor([3, 1, 0], dtype=torch.int32),
        sampled=torch.tensor([5, 4, 3]),
        selected_logprobs=torch.tensor([-1.0, 0.0, -2.0]),
    )
    mask = SamplingMask.from_sglang(fixed, temperature=1.0, step=2)
    assert mask.to_lists() == [[2, 5, 7], [4], []]
    assert mask.sampled.tolist() == [5, 4, 3]
    assert mask.logprobs.tolist() == [-1.0, 0.0, -2.0]
    assert mask.extras["step"].tolist() == [2, 2, 2]
    assert mask.metadata["engine"] == "sglang"
    as_dict = SamplingMask.from_sglang({"token_ids": fixed.token_ids.tolist(), "counts": [3, 1, 0]})
    assert as_dict.to_lists() == mask.to_lists()
    with pytest.raises(EngineOutputError, match=r"row 0: sampled token 6 is not among its 3 ids"):
        SamplingMask.from_sglang(dict(vars(fixed), sampled=torch.tensor([6, 4, 3])))
    with pytest.raises(EngineOutputError, match=r"row 1: count 5 is outside \[0, 4\]"):
        SamplingMask.from_sglang({"token_ids": fixed.token_ids, "lengths": [3, 5, 0]})


def _fixed(**fields):
    base = dict(token_ids=torch.tensor([[7, 2, 5, 0], [4, 0, 0, 0], [9, 9, 9, 9]], dtype=torch.int32),
                lengths=torch.tensor([3, 1, 0], dtype=torch.int32), sampled=torch.tensor([5, 4, 3]),
                selected_logprobs=torch.tensor([-1.0, 0.0, -2.0]))
    return {**base, **fields}


F = r"sglang fixed-capacity mask: row "


@pytest.mark.parametrize("fields, message", [
    (dict(selected_logprobs=torch.tensor([-1.0, math.nan, -2.0])), F + r"1: selected_logprobs nan is not a log-prob"),
    (dict(selected_logprobs=torch.tensor([-1.0, 0.0, math.inf])), F + r"2: selected_logprobs inf is not a log-prob"),
    (dict(selected_logprobs=[-1.0, 0.5, -2.0]), F + r"1: selected_logprobs 0.5 is not a log-prob"),
    (dict(selected_logprobs=torch.tensor([-1e300, 0.0, -2.0], dtype=torch.float64)),
     F + r"0: selected_logprobs -1e\+300 is out of float32 range"),
    (dict(selected_logprobs=["x", 0.0, -2.0]), F + r"0: selected_logprobs is 'x', not a number"),
    (dict(selected_logprobs=np.array(["-1", "0", "-2"])), F + r"0: selected_logprobs is '-1', not a number"),
    (dict(selected_logprobs=[-1.0, None, -2.0]), F + r"1: selected_logprobs is None, not a number"),
    (dict(selected_logprobs=torch.tensor([True, False, True])), r"logprobs: expected numbers, got a torch.bool"),
    (dict(selected_logprobs=torch.zeros(3, 1)), r"selected_logprobs: expected a 1-D sequence, got shape \(3, 1\)"),
    (dict(selected_logprobs=[-1.0, 0.0]), r"logprobs must be a tensor of shape \[3\], got \(2,\)"),
    (dict(sampled=["a", "b", "c"]), r"sglang fixed-capacity mask: sampled is not an integer array"),
    (dict(sampled=torch.tensor([5.5, 4.0, 3.0])), r"sampled must be a 1-D integer tensor, got torch.float32"),
])
def test_sglang_fixed_capacity_bad_values_are_named(fields, message):
    """Regression: NaN and +inf log-probs went through silently (the JSON form refuses them), strings
    were a bare torch error, and a float `sampled` was truncated to an id."""
    with pytest.raises(EngineOutputError, match=message):
        SamplingMask.from_sglang(_fixed(**fields))


def test_sglang_fixed_capacity_logprobs_as_lists_and_arrays():
    """The same values as a tensor, a list, a float64 array; -inf (probability 0) and 0 are log-probs."""
    want = [-1.0, 0.0, -math.inf]
    for lp in (torch.tensor(want), want, np.array(want, dtype=np.float64), [-1, 0, -math.inf]):
        mask = SamplingMask.from_sglang(_fixed(selected_logprobs=lp))
        assert mask.logprobs.dtype == torch.float32 and mask.logprobs.tolist() == want


# ---- padded layouts -----------------------------------------------------------------------------
def reference_padded(rows, width):
    ids = [[-1] * width for _ in rows]
    for r, row in enumerate(rows):
        for s, t in enumerate(sorted(row)):
            ids[r][s] = t
    return ids, [len(r) for r in rows]


@given(rows=row_lists, extra=st.integers(0, 3))
def test_to_padded_matches_reference_and_round_trips(rows, extra):
    mask = SamplingMask.from_lists(rows, sampled=torch.arange(len(rows)), logprobs=torch.zeros(len(rows)))
    width = max([len(r) for r in rows], default=0) + extra
    ids, counts = mask.to_padded(width)
    ref_ids, ref_counts = reference_padded(rows, width)
    assert ids.dtype == torch.int32 and counts.dtype == torch.int32
    assert ids.tolist() == (ref_ids if rows else []) and ids.shape == (len(rows), width)
    assert counts.tolist() == ref_counts
    back = SamplingMask.from_padded(ids, counts)
    assert back.to_lists() == [sorted(r) for r in rows]
    back.validate()


@given(rows=row_lists, data=st.data())
def test_from_padded_sorts_unsorted_rows(rows, data):
    width = max([len(r) for r in rows], default=0)
    shuffled = [data.draw(st.permutations(r)) for r in rows]
    padded = [list(r) + [-1] * (width - len(r)) for r in shuffled]
    ids = torch.tensor(padded, dtype=torch.int64).reshape(len(rows), width)
    mask = SamplingMask.from_padded(ids, torch.tensor([len(r) for r in rows], dtype=torch.int64))
    assert mask.to_lists() == [sorted(r) for r in rows]


def test_to_padded_names_a_row_wider_than_width():
    mask = SamplingMask.from_lists([[1], [1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"row 1 has 3 ids, more than the width 2"):
        mask.to_padded(2)
    with pytest.raises(ValueError, match=r"width must be an integer >= 0"):
        mask.to_padded(-1)
    assert mask.to_padded()[0].shape == (3, 4)


def test_from_padded_keeps_unsampled_rows_and_extras():
    ids = torch.tensor([[3, 1, -1], [-1, -1, -1]], dtype=torch.int32)
    mask = SamplingMask.from_padded(ids, torch.tensor([2, 0]), sampled=torch.tensor([3, 0]),
                                    logprobs=torch.tensor([-0.1, 0.0]), sequence=torch.tensor([4, 4]))
    assert mask.to_lists() == [[1, 3], []]
    assert mask.sampled.tolist() == [3, 0] and mask.extras["sequence"].tolist() == [4, 4]


@pytest.mark.parametrize("ids, counts, kwargs, message", [
    ([[1, 2]], [3], {}, r"row 0: count 3 is outside \[0, 2\]"),
    ([[1, 2]], [-1], {}, r"row 0: count -1 is outside"),
    ([[1, 2], [3, 4]], [2], {}, r"counts has 1 entries for 2 rows"),
    ([[1, -5]], [2], {}, r"row 0 slot 1: id -5 is out of range \[0, 2147483648\)"),
    ([[1, 9]], [2], {"vocab_size": 9}, r"row 0 slot 1: id 9 is out of range \[0, 9\)"),
    ([[1, 7], [1, 0]], [2, 1], {}, r"row 1 slot 1: padding past count 1 must be -1, got 0"),
    ([[4, 4, -1]], [2], {}, r"row 0: id 4 appears twice"),
    ([[1.0, 2.0]], [2], {}, r"ids must be a 2-D integer tensor"),
    ([1, 2], [2], {}, r"ids must be a 2-D integer tensor"),
    ([[1, 2]], [[2]], {}, r"counts must be a 1-D integer tensor"),
    ([[1, 2]], [2], {"sampled": torch.tensor([5])}, r"row 0: sampled token 5 is not among its 2 ids"),
    ([[1, 2]], [2], {"logprobs": torch.zeros(2)}, r"logprobs must be a tensor of shape \[1\]"),
])
def test_from_padded_errors(ids, counts, kwargs, message):
    with pytest.raises(EngineOutputError, match=message):
        SamplingMask.from_padded(torch.tensor(ids), torch.tensor(counts), **kwargs)


def test_from_padded_lenient_padding_for_compact_buffers():
    ids = torch.tensor([[5, 2, 77], [8, 31337, 0]])  # unwritten slots hold garbage
    mask = SamplingMask.from_padded(ids, torch.tensor([2, 1]), strict_padding=False)
    assert mask.to_lists() == [[2, 5], [8]]


def test_convert_help():
    result = run("convert", "--help")
    assert result.exit_code == 0 and "--from" in result.output and "vllm-json" in result.output


# ---- engine JSON files --------------------------------------------------------------------------
def test_read_engine_json_document_and_lines(tmp_path):
    from mask_replay.errors import DumpError
    from mask_replay.files.engine_json import read_engine_json

    responses = fixture("vllm_generate.json")
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps(responses))
    lines = tmp_path / "lines.jsonl"
    lines.write_text(json.dumps(responses[0]) + "\n\n" + json.dumps(responses[1:]) + "\n")
    assert read_engine_json(doc) == responses == read_engine_json(lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(responses[0]) + "\n{oops\n")
    with pytest.raises(DumpError, match=r"bad.jsonl: line 2: not valid JSON"):
        read_engine_json(bad)
    one = tmp_path / "one.json"
    one.write_text("{oops")
    with pytest.raises(DumpError, match=r"one.json: not valid JSON \(line 1"):
        read_engine_json(one)
    num = tmp_path / "num.json"
    num.write_text("[1]")
    with pytest.raises(DumpError, match=r"num.json: response 0 is a JSON int, expected an object"):
        read_engine_json(num)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DumpError, match=r"bin.json: not UTF-8 text"):
        read_engine_json(binary)


# ---- CLI ----------------------------------------------------------------------------------------
def test_convert_vllm_json_to_mask_and_padded_round_trip(tmp_path):
    src = os.path.join(FIXTURES, "vllm_generate.json")
    mask_path, padded_path, back = tmp_path / "m.safetensors", tmp_path / "p.safetensors", tmp_path / "b.safetensors"
    result = run("convert", src, "-o", mask_path, "--from", "vllm-json", "--temperature", "0.7", "--step", "3")
    assert result.exit_code == 0, result.output
    assert "6 rows" in result.output
    mask = SamplingMask.load(mask_path)
    assert mask == SamplingMask.from_vllm(fixture("vllm_generate.json"), temperature=0.7, step=3)
    assert json.loads(mask.metadata["sequences"])[0] == ["req-a", 0]

    result = run("convert", mask_path, "-o", padded_path, "--from", "mask", "--to", "padded", "--width", "5")
    assert result.exit_code == 0, result.output
    t = load_file(str(padded_path))
    ids, counts = mask.to_padded(5)
    assert torch.equal(t["ids"], ids) and torch.equal(t["counts"], counts)
    assert torch.equal(t["sampled"], mask.sampled) and torch.equal(t["step"], mask.extras["step"])

    result = run("convert", padded_path, "-o", back, "--from", "padded", "--to", "mask")
    assert result.exit_code == 0, result.output
    assert SamplingMask.load(back) == mask


def test_convert_sglang_json_to_padded(tmp_path):
    out = tmp_path / "p.safetensors"
    result = run("convert", os.path.join(FIXTURES, "sglang_generate.json"), "-o", out, "--from", "sglang-json",
                 "--to", "padded")
    assert result.exit_code == 0, result.output
    t = load_file(str(out))
    assert t["ids"].tolist() == [[3, 12, 30], [5, -1, -1], [8, 9, -1], [2, 4, 9], [1, -1, -1]]
    assert t["counts"].tolist() == [3, 1, 2, 3, 1]


def test_convert_errors_are_one_line_and_write_nothing(tmp_path):
    src = os.path.join(FIXTURES, "vllm_generate.json")
    out = tmp_path / "o.safetensors"
    broken = tmp_path / "broken.json"
    responses = fixture("vllm_generate.json")
    c1(responses)["sampling_mask"][0].remove(7)
    broken.write_text(json.dumps(responses))
    assert_one_line_error(run("convert", broken, "-o", out, "--from", "vllm-json"),
                          "broken.json: request 0 (id 'req-a') choice 1 token 0: sampled token 7")
    assert_one_line_error(run("convert", src, "-o", out, "--from", "sglang-json"), "response 0 choice 1: no meta_info")
    assert_one_line_error(run("convert", src, "-o", out, "--from", "vllm-json", "--vocab-size", "5"),
                          "out of range [0, 5)")
    mask_path = tmp_path / "m.safetensors"
    assert run("convert", src, "-o", mask_path, "--from", "vllm-json").exit_code == 0
    assert_one_line_error(run("convert", mask_path, "-o", out, "--from", "mask", "--to", "padded", "--width", "2"),
                          "--width 2: row 1 has 4 ids, more than the width 2")
    assert_one_line_error(run("convert", mask_path, "-o", out, "--from", "padded"), "missing key 'ids'")
    assert_one_line_error(run("convert", mask_path, "-o", out, "--from", "mask", "--to", "mask"), "nothing to convert")
    assert_one_line_error(run("convert", src, "-o", out, "--from", "vllm-json", "--width", "3"), "--width applies")
    assert_one_line_error(run("convert", mask_path, "-o", out, "--from", "mask", "--to", "padded", "--step", "1"),
                          "--step applies to engine JSON input only")
    assert_one_line_error(run("convert", src, "-o", tmp_path / "nofolder" / "x", "--from", "vllm-json"),
                          "does not exist")
    assert_one_line_error(run("convert", tmp_path / "missing.json", "-o", out, "--from", "vllm-json"), "no such file")
    assert_clean(tmp_path, "o.safetensors")
    # the output may not overwrite the input, which stays as it was
    before = open(mask_path, "rb").read()
    assert_one_line_error(run("convert", mask_path, "-o", mask_path, "--from", "mask", "--to", "padded"),
                          "would overwrite the input")
    assert open(mask_path, "rb").read() == before


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "1e39", "temperature 1e+39 overflows in float32"),
    ("--temperature", "1e-46", "temperature 1e-46 rounds to 0 in float32"),
    ("--step", str(2 ** 70), f"step {2 ** 70} does not fit in a 64-bit integer"),
])
def test_convert_values_a_mask_cannot_hold_are_one_line_errors(tmp_path, flag, value, needle):
    """Regression: 1e39 and 2**70 were tracebacks from torch.full, and 1e-46 silently became a
    temperature of 0 (greedy) in the float32 column."""
    out = tmp_path / "o.safetensors"
    result = run("convert", os.path.join(FIXTURES, "vllm_generate.json"), "-o", out, "--from", "vllm-json", flag, value)
    assert_one_line_error(result, needle)
    assert_clean(tmp_path, "o.safetensors")
    with pytest.raises(EngineOutputError, match=re.escape(needle)):
        SamplingMask.from_vllm(fixture("vllm_generate.json"), **{flag[2:]: float(value) if flag == "--temperature"
                                                                  else int(value)})


# ---- convert -> score, without rollout logits ---------------------------------------------------
def engine_rollout(v=40, n_seq=3, length=5, temperature=0.8, top_p=0.8, seed=0):
    """An engine's response for logits we know: each token's mask is the top-p support of its
    logits at the temperature, with the support-normalised log-prob of the sampled token."""
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(n_seq * length, v, generator=g, dtype=torch.float64)
    choices = []
    for s in range(n_seq):
        rows, toks, lps = [], [], []
        for t in range(length):
            p = torch.softmax(z[s * length + t] / temperature, 0)
            order = torch.argsort(p, descending=True)
            cum = torch.cumsum(p[order], 0)
            k = int((cum < top_p).sum()) + 1
            support = order[:k].tolist()
            y = support[int(torch.randint(k, (1,), generator=g))]
            lp = math.log(p[y] / p[support].sum())
            rows.append(support[::-1])  # engine order, not sorted
            toks.append(y)
            lps.append({"logprob": lp})
        choices.append({"index": s, "token_ids": toks, "sampling_mask": rows, "logprobs": {"content": lps}})
    return {"request_id": "r", "choices": choices}, z


def test_convert_then_score_from_an_engine_mask(tmp_path):
    response, z = engine_rollout()
    src = tmp_path / "vllm.json"
    src.write_text(json.dumps(response))
    masks, train, report = tmp_path / "m.safetensors", tmp_path / "t.safetensors", tmp_path / "s.json"
    train_logits = (z + 0.05 * torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype)).float()
    save_file({"logits": train_logits.contiguous()}, str(train))
    assert run("convert", src, "-o", masks, "--from", "vllm-json", "--temperature", "0.8").exit_code == 0
    result = run("score", "--masks", masks, "--training", train, "--json", report)
    assert result.exit_code == 0, result.output
    rep = json.loads(report.read_text())
    assert rep["tokens"] == 15 and rep["replay"]["sequences"] == 3
    # independent reference: training log-prob over the engine's support vs the engine's log-prob
    diffs, diffs_full = [], []
    for s, ch in enumerate(response["choices"]):
        for t, (y, m) in enumerate(zip(ch["token_ids"], ch["sampling_mask"])):
            x = train_logits[s * 5 + t].double() / 0.8
            rep_lp = x[y] - torch.logsumexp(x[m], 0)
            diffs.append(float(rep_lp) - ch["logprobs"]["content"][t]["logprob"])
            diffs_full.append(float(torch.log_softmax(x, 0)[y]) - ch["logprobs"]["content"][t]["logprob"])
    assert rep["replay"]["logp_diff_mean"] == pytest.approx(np.mean(diffs), abs=1e-5)
    assert rep["no_replay"]["logp_diff_mean"] == pytest.approx(np.mean(diffs_full), abs=1e-5)
    assert abs(rep["replay"]["logp_diff_mean"]) < abs(rep["no_replay"]["logp_diff_mean"])


def test_score_leaves_unsampled_rows_out(tmp_path):
    response, z = engine_rollout()
    ch = response["choices"][1]
    ch["sampling_mask"][2] = []  # a token the engine did not sample (e.g. forced)
    src, masks, train, report = (tmp_path / n for n in ("v.json", "m.safetensors", "t.safetensors", "s.json"))
    src.write_text(json.dumps(response))
    save_file({"logits": z.float().contiguous()}, str(train))
    assert run("convert", src, "-o", masks, "--from", "vllm-json", "--temperature", "0.8").exit_code == 0
    result = run("score", "--masks", masks, "--training", train, "--json", report)
    assert result.exit_code == 0, result.output
    assert "1 row with an empty support" in result.stderr
    assert "sampled outside" not in result.stderr
    rep = json.loads(report.read_text())
    assert rep["tokens"] == 14
    # same logits on both sides: replay reproduces the engine's log-probs
    assert rep["replay"]["logp_diff_mean"] == pytest.approx(0.0, abs=1e-5)


# ---- numbers beyond float32 in engine log-probs ---------------------------------------------------
def _token_lp(r, text):
    c1(r)["logprobs"]["content"][0]["logprob"] = text


def _entry_lp(r, text):  # the non-sampled entry (id 10) of request req-c's only row
    r[2]["choices"][0]["sampling_mask_logprobs"][0][1] = text


@pytest.mark.parametrize("edit, value, needle", [
    (_token_lp, "-1" + "0" * 400, "request 0 (id 'req-a') choice 1 token 0: log-prob -10000000000... (401 digits)"),
    (_token_lp, "1" + "0" * 400, "request 0 (id 'req-a') choice 1 token 0: log-prob 100000000000... (401 digits)"),
    (_token_lp, "-1e300", "request 0 (id 'req-a') choice 1 token 0: log-prob -1e+300"),
    (_token_lp, "-1e39", "request 0 (id 'req-a') choice 1 token 0: log-prob -1e+39"),
    (_entry_lp, "-1" + "0" * 400, "request 2 (id 'req-c') choice 0 token 0: sampling-mask log-prob -10000000000..."),
    (_entry_lp, "-1e300", "request 2 (id 'req-c') choice 0 token 0: sampling-mask log-prob -1e+300"),
])
def test_convert_logprobs_beyond_float32_are_one_line_errors(tmp_path, edit, value, needle):
    """Regression: a JSON integer beyond a float (10**400) was an OverflowError traceback, and -1e300
    printed numpy's overflow RuntimeWarning (then became -inf, or a row that does not normalise)."""
    responses = fixture("vllm_generate.json")
    edit(responses, "@VALUE@")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(responses).replace('"@VALUE@"', value))
    out = tmp_path / "o.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning would be a second line on stderr
        assert_one_line_error(run("convert", path, "-o", out, "--from", "vllm-json"), "r.json: " + needle,
                              "out of float32 range")
    assert_clean(tmp_path, "o.safetensors")


def test_convert_integer_too_long_to_read_is_one_line(tmp_path):
    """More digits than Python's int() reads: was reported against --width (a ValueError)."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(fixture("vllm_generate.json")).replace("-0.25", "-1" + "0" * 5000))
    assert_one_line_error(run("convert", path, "-o", tmp_path / "o.safetensors", "--from", "vllm-json"),
                          "r.json: an integer of more than", "digits")
    lines = tmp_path / "r.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in fixture("vllm_generate.json")).replace("-0.25", "1" * 5000))
    assert_one_line_error(run("convert", lines, "-o", tmp_path / "o.safetensors", "--from", "vllm-json"),
                          "r.jsonl: line 1: an integer of more than")
    assert_clean(tmp_path, "o.safetensors")


@pytest.mark.parametrize("read", [
    lambda: SamplingMask.from_vllm({"request_id": "r", "choices": [
        {"index": 0, "token_ids": [2**32 + 5], "sampling_mask": [[2**32 + 5]]}]}, vocab_size=2**40),
    lambda: SamplingMask.from_sglang({"output_ids": [2**32 + 5], "meta_info": {
        "id": "s", "output_token_sampling_mask": [[2**32 + 5]]}}, vocab_size=2**40),
    lambda: SamplingMask.from_padded(torch.tensor([[2**32 + 5]]), torch.tensor([1]), vocab_size=2**40),
])
def test_an_id_beyond_int32_is_refused_whatever_vocab_size_says(read):
    # with a vocab_size above 2^31 the id passed the range check and wrapped to 5 in the int32 cast
    with pytest.raises(EngineOutputError, match=r"id 4294967301 is out of range \[0, 2147483648\)"):
        read()


# ---- a one-id row's log-prob over its support is 0, whichever reader (issue 48, item 4) ----------------
def greedy_generation(seed: int, tokens: int, vocab: int):
    """(argmax tokens, their full-vocabulary log-softmax, every id's): what vLLM 0.32 reports for greedy
    rows, in processed_logprobs mode too (untruncated)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(tokens, vocab, generator=g, dtype=torch.float64), -1)
    sampled = lp.argmax(-1).tolist()
    return sampled, [float(lp[t, s]) for t, s in enumerate(sampled)], lp


def every_reader(sampled, token_lp, lp):
    """The masks the same greedy generation gives through every reader of its engine's outputs."""
    v = lp.shape[1]
    rows = [[s] for s in sampled]
    support = wire.join([np.array(r, np.int32) for r in rows], v)
    offline = SimpleNamespace(request_id="r", outputs=[SimpleNamespace(
        index=0, token_ids=sampled, logprobs=[{s: SimpleNamespace(logprob=x)} for s, x in zip(sampled, token_lp)],
        sampling_support=support)])
    content = {"content": [{"token": f"token_id:{s}", "logprob": x} for s, x in zip(sampled, token_lp)]}
    tops = [{f"token_id:{i}": float(lp[t, i]) for i in range(v)} for t in range(len(sampled))]
    yield "plugin, offline", SamplingMask.from_vllm(offline)
    yield "plugin, server JSON", SamplingMask.from_vllm({"request_id": "r", "choices": [
        {"index": 0, "token_ids": sampled, "logprobs": content, "sampling_support": support_to_json(support)}]})
    yield "vLLM's sampling_mask", SamplingMask.from_vllm({"request_id": "r", "choices": [
        {"index": 0, "token_ids": sampled, "logprobs": content, "sampling_mask": rows}]})
    native = SimpleNamespace(token_ids=rows, logprobs=[[x] for x in token_lp])  # vllm.outputs.SamplingMask
    yield "vLLM's SamplingMask with log-probs", SamplingMask.from_vllm(SimpleNamespace(
        request_id="r", outputs=[SimpleNamespace(index=0, token_ids=sampled, logprobs=None, sampling_mask=native)]))
    yield "processed log-probs", mask_from_vllm_logprobs(
        {"id": "c", "choices": [{"index": 0, "logprobs": {"tokens": [f"token_id:{s}" for s in sampled],
                                                           "token_logprobs": token_lp, "top_logprobs": tops}}]},
        logprobs=v, temperature=0.0)
    yield "TRL's vLLM", mask_from_trl_vllm([sampled], [[[x] for x in token_lp]], [[[s] for s in sampled]],
                                           requested=1, temperature=0.0)
    yield "SGLang", SamplingMask.from_sglang({"output_ids": sampled, "meta_info": {
        "id": "s", "output_token_sampling_mask": rows, "output_token_sampling_logprobs": token_lp}})
    yield "SGLang fixed capacity", SamplingMask.from_sglang({
        "token_ids": torch.tensor(rows), "lengths": torch.ones(len(rows), dtype=torch.int32),
        "sampled": torch.tensor(sampled), "selected_logprobs": torch.tensor(token_lp)})


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 6), st.integers(2, 40))
def test_every_reader_gives_a_one_id_row_log_prob_0(seed, tokens, vocab):
    sampled, token_lp, lp = greedy_generation(seed, tokens, vocab)
    for name, mask in every_reader(sampled, token_lp, lp):
        assert mask.to_lists() == [[s] for s in sampled], name
        assert mask.logprobs.tolist() == [0.0] * tokens, name  # not the full-vocabulary -1.119
        assert mask.entry_logprobs is None or mask.entry_logprobs.tolist() == [0.0] * tokens, name


def test_only_one_id_rows_are_pinned():
    # a sampled row keeps the engine's value (its processed log-prob over its support)
    offline = SimpleNamespace(request_id="r", outputs=[SimpleNamespace(
        index=0, token_ids=[3, 5], logprobs=[{3: -1.119}, {5: -0.7}], sampling_mask=[[3], [1, 5]])])
    assert SamplingMask.from_vllm(offline).logprobs.tolist() == pytest.approx([0.0, -0.7])
