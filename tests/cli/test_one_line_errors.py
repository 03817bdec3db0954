"""Every failure is one line on stderr and exit != 0, never a traceback: demo sizes and seeds that
overflow, a padded width the allocator refuses, .pt dumps of meta tensors, JSON nested past Python's
recursion limit; and user text (file names, keys, metadata) goes to the terminal as it is, whatever
rich markup or control characters it holds."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import assert_one_line_error, rollout_tensors, run, write


@pytest.mark.parametrize("args, needle", [
    (["--vocab", str(10 ** 12)], "--vocab 1000000000000"),
    (["--vocab", str(2 ** 30), "--tokens-per-step", "64"], "GiB"),
    (["--seed", str(2 ** 70)], "--seed"),
    (["--seed", "-1"], "--seed"),
])
def test_demo_sizes_and_seeds_out_of_range(tmp_path, args, needle):
    result = run("demo", "--out", tmp_path / "d", *args)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "d").exists()


def test_convert_to_padded_with_an_impossible_width(tmp_path, captured):
    for width in (10 ** 12, 2 ** 31):
        result = run("convert", captured, "--from", "mask", "--to", "padded", "--width", width,
                     "-o", tmp_path / "p.safetensors")
        assert_one_line_error(result, f"--width {width}")
    assert not (tmp_path / "p.safetensors").exists()


def test_pt_dump_of_meta_tensors(tmp_path):
    path = tmp_path / "r.pt"
    torch.save({"logits": torch.empty(4, 8, device="meta"), "sampled": torch.zeros(4, dtype=torch.int64)}, path)
    for args in (["capture", path, "-o", tmp_path / "m.safetensors"], ["inspect", path]):
        assert_one_line_error(run(*args), "key 'logits'", "meta tensor")


def test_deeply_nested_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("[" * 100000 + "]" * 100000)
    result = run("convert", path, "--from", "vllm-json", "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "nested too deeply")
    path.write_text(json.dumps({"a": 1}) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    assert_one_line_error(run("convert", path, "--from", "sglang-json", "-o", tmp_path / "m.safetensors"),
                          "line 2", "nested too deeply")


@pytest.mark.parametrize("name", ["[red]x.safetensors", "a[INST]b[bold.safetensors", ":x: [link=y]z.safetensors"])
def test_file_names_and_metadata_with_markup_print_as_they_are(tmp_path, name):
    tensors = rollout_tensors()
    path = tmp_path / name
    save_file(tensors, str(path), metadata={"prompt": "[INST] hi [/INST]", "note": "[bold]"})
    result = run("inspect", path)
    assert result.exit_code == 0, result.output
    assert _squeezed(name) in _squeezed(result.output)  # the table title wraps long names
    assert "[INST] hi [/INST]" in result.output and "[bold]" in result.output
    out = tmp_path / ("out" + name)
    result = run("capture", path, "-o", out)
    assert result.exit_code == 0, result.output
    assert _squeezed(str(out)) in _squeezed(result.output)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def test_an_error_about_a_path_with_a_newline_is_one_line(tmp_path):
    path = write(tmp_path / "bad\nname.safetensors", {"logits": torch.zeros(2, 3)})
    result = run("capture", path, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "bad\\nname.safetensors", "sampled")


def test_demo_with_few_tokens_per_step_runs(tmp_path):
    result = run("demo", "--out", tmp_path / "d", "--tokens-per-step", "4", "--steps", "2", "--vocab", "64")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "score.json").is_file()
