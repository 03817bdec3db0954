"""Values that cannot be right are refused, one line naming where, never turned into an answer:
engine log-probs above 0, NaN or +inf; engine responses without completions; a mask file's kept mass
outside [0, 1] or log-probs above 0; subnormal temperatures; a mask whose offsets decrease; a padded
file whose other tensors would collide with the mask's own keys or the reader's arguments."""
import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import mask_replay as mr
from mask_replay.errors import EngineOutputError, MaskFormatError
from tests.helpers import assert_one_line_error, rollout_tensors, run, write

VLLM = {"request_id": "r0", "choices": [{
    "index": 0, "token_ids": [3, 5],
    "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.1}]},
    "sampling_mask": [[3, 4], [5]]}]}
SGLANG = {"output_ids": [3, 5], "meta_info": {"id": "s0", "output_token_sampling_mask": [[3, 4], [5]],
                                              "output_token_sampling_logprobs": [-0.5, -0.1]}}


def _vllm(edit):
    doc = copy.deepcopy(VLLM)
    edit(doc)
    return doc


def _choice(doc):
    return doc["choices"][0]


@pytest.mark.parametrize("value", [0.5, math.nan, math.inf])
def test_engine_logprob_that_is_no_logprob_is_refused(value):
    doc = _vllm(lambda d: _choice(d)["logprobs"]["content"][1].update(logprob=value))
    with pytest.raises(EngineOutputError, match=r"choice 0 token 1: log-prob .* is not a log-probability"):
        mr.SamplingMask.from_vllm(doc)
    doc = _vllm(lambda d: _choice(d).update(sampling_mask_logprobs=[[-0.1, value], [0.0]]))
    with pytest.raises(EngineOutputError, match=r"choice 0 token 0: sampling-mask log-prob .* not a log-probability"):
        mr.SamplingMask.from_vllm(doc)
    sg = copy.deepcopy(SGLANG)
    sg["meta_info"]["output_token_sampling_logprobs"][0] = value
    with pytest.raises(EngineOutputError, match=r"token 0: log-prob .* is not a log-probability"):
        mr.SamplingMask.from_sglang(sg)


def test_engine_logprob_rounding_above_zero_and_minus_inf_pass():
    doc = _vllm(lambda d: _choice(d)["logprobs"]["content"][1].update(logprob=3e-7))
    assert mr.SamplingMask.from_vllm(doc).num_rows == 2
    doc = _vllm(lambda d: _choice(d)["logprobs"]["content"][0].update(logprob=-math.inf))
    assert mr.SamplingMask.from_vllm(doc).num_rows == 2


@pytest.mark.parametrize("choices, needle", [
    (None, "choices is null"), ([5], "choice at position 0: 5 is not a completion"),
    ([None], "choice at position 0: None is not a completion"), (7, "choices: expected a list"),
])
def test_vllm_choices_that_are_no_completions_are_refused(choices, needle):
    with pytest.raises(EngineOutputError, match=needle):
        mr.SamplingMask.from_vllm(_vllm(lambda d: d.update(choices=choices)))


@pytest.mark.parametrize("logprobs", [5, True, 0.5, "x"])
def test_vllm_logprobs_that_are_a_scalar_are_one_error(logprobs):
    with pytest.raises(EngineOutputError, match="choice 0: logprobs is .* expected per-token log-probs"):
        mr.SamplingMask.from_vllm(_vllm(lambda d: _choice(d).update(logprobs=logprobs)))


def test_sglang_null_choices_are_refused():
    with pytest.raises(EngineOutputError, match="response 0: choices is null"):
        mr.SamplingMask.from_sglang({"id": "chat", "choices": None})


def test_convert_of_a_broken_engine_file_is_one_line(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_vllm(lambda d: _choice(d)["logprobs"]["content"][0].update(logprob=2.0))))
    result = run("convert", path, "--from", "vllm-json", "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "token 0: log-prob 2.0 is not a log-probability")
    assert not (tmp_path / "m.safetensors").exists()


def _mask_file(tmp_path, name, **row_values):
    """A mask file for the `rollout` fixture's rows, with some per-row values replaced."""
    captured = tmp_path / "captured.safetensors"
    if not captured.exists():
        assert run("capture", tmp_path / "rollout.safetensors", "-o", captured).exit_code == 0
    tensors = load_file(str(captured))
    for key, (row, value) in row_values.items():
        tensors[key] = tensors.get(key, torch.zeros_like(tensors["logprobs"])).clone()
        tensors[key][row] = value
    out = tmp_path / name
    save_file(tensors, str(out))
    return out


@pytest.mark.parametrize("key, value, rule", [
    ("kept_mass", 4.61, "kept mass must lie in [0, 1]"), ("kept_mass", -0.5, "kept mass must lie in [0, 1]"),
    ("logprobs", 0.7, "log-prob must be <= 0"), ("logprobs", math.inf, "log-prob must be <= 0"),
])
def test_mask_file_values_out_of_range_are_refused_by_score_and_inspect(tmp_path, rollout, key, value, rule):
    masks = _mask_file(tmp_path, "bad.safetensors", **{key: (2, value)})
    training = write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})
    result = run("score", "--masks", masks, "--training", training)
    assert_one_line_error(result, f"key '{key}'", "row 2", rule)
    result = run("inspect", masks)
    assert result.exit_code != 0 and rule in result.stderr
    with pytest.raises(MaskFormatError, match="row 2"):
        mr.SamplingMask.load(masks)


def test_in_memory_mask_with_kept_mass_above_one_fails_validate():
    mask = mr.SamplingMask.from_lists([[1, 2], [3]], kept_mass=torch.tensor([0.5, 1.5]))
    with pytest.raises(MaskFormatError, match="row 1 has kept_mass 1.5"):
        mask.validate()
    mr.SamplingMask.from_lists([[1, 2], [3]], kept_mass=torch.tensor([1.00001, math.nan])).validate()


@pytest.mark.parametrize("value", ["1e-40", "1e-39"])
def test_subnormal_temperature_is_refused(tmp_path, rollout, value):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(VLLM))
    result = run("convert", path, "--from", "vllm-json", "-o", tmp_path / "m.safetensors", "--temperature", value)
    assert_one_line_error(result, f"temperature {value} is subnormal")
    result = run("capture", rollout, "-o", tmp_path / "c.safetensors", "--temperature", value)
    assert_one_line_error(result, "subnormal")
    with pytest.raises(ValueError, match="subnormal"):
        mr.capture(torch.randn(2, 8), temperature=float(value))


def test_inspect_refuses_a_mask_whose_offsets_decrease(tmp_path):
    path = write(tmp_path / "m.safetensors", {"token_ids": torch.tensor([1, 2, 3, 4], dtype=torch.int32),
                                              "offsets": torch.tensor([0, 3, 1, 4])})
    result = run("inspect", path)
    assert result.exit_code != 0
    assert "offsets decrease at row 1" in result.stderr
    assert "support size" not in result.output


@pytest.mark.parametrize("extra", ["offsets", "token_ids", "source", "vocab_size"])
def test_padded_file_with_a_reserved_tensor_name_is_refused(tmp_path, extra):
    ids = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    path = write(tmp_path / "p.safetensors", {"ids": ids, "counts": torch.tensor([2, 1], dtype=torch.int32),
                                              extra: torch.tensor([0, 7])})
    result = run("convert", path, "--from", "padded", "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, f"key '{extra}'", "reserved")
    assert not (tmp_path / "m.safetensors").exists()


def test_padded_file_with_kept_mass_above_one_is_refused(tmp_path):
    ids = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    path = write(tmp_path / "p.safetensors", {"ids": ids, "counts": torch.tensor([2, 1], dtype=torch.int32),
                                              "kept_mass": torch.tensor([0.5, 2.0])})
    result = run("convert", path, "--from", "padded", "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "row 1 has kept_mass 2:")
