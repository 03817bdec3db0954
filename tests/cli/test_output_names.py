"""Every name the file system allows is writable (the hidden temp file beside it is shortened to
fit), and a name it refuses is refused before any work, with one line and nothing left behind."""
import os

import pytest

from tests.helpers import assert_one_line_error, rollout_tensors, run, write


def _legal_longest(tmp_path, ext):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    return "m" * (limit - len(ext)) + ext


@pytest.mark.parametrize("name", ["longest", "with\nnewline.safetensors", "é" * 120 + ".safetensors",
                                  "-dash.safetensors", " spaced .safetensors"])
def test_legal_output_names_are_written(tmp_path, rollout, name):
    if name == "longest":
        name = _legal_longest(tmp_path, ".safetensors")
    out = tmp_path / name
    result = run("capture", rollout, "-o", out)
    assert result.exit_code == 0, result.output
    assert out.is_file()
    js = tmp_path / (name[:-len(".safetensors")] + ".json")
    training = write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})
    result = run("score", "--masks", out, "--training", training, "--json", js)
    assert result.exit_code == 0, result.output
    assert js.is_file()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_name_too_long_is_refused_before_any_work(tmp_path, rollout, captured):
    name = "m" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)
    before = sorted(os.listdir(tmp_path))
    assert_one_line_error(run("capture", rollout, "-o", tmp_path / name), "long")
    training = write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})
    assert_one_line_error(run("score", "--masks", captured, "--training", training, "--json", tmp_path / name),
                          "long")
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["t.safetensors"])
