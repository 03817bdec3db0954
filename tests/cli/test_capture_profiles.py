"""`mask-replay capture --profile` and the log-prob mismatch report, end to end on small dumps."""
import json

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import mask_replay
from mask_replay import SamplingMask
from mask_replay.cli.main import main
from mask_replay.sampler.profiles import semantics
from mask_replay.sampler.profiles.mismatch import CAUSES

N, V = 12, 8
# every row is the tie-group row: exact keeps 5 tokens, vLLM 4, SGLang another 4
TIE_ROW = torch.tensor([6.0, 5, 4, 4, 4, 2, 1, 0])


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def dump(tmp_path, name="r.safetensors", **extra):
    tensors = {"logits": TIE_ROW.repeat(N, 1), "sampled": torch.zeros(N, dtype=torch.int64),
               "top_p": torch.tensor(0.9)}
    tensors.update(extra)
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def engine_logprobs(profile):
    mask = mask_replay.capture(TIE_ROW.repeat(N, 1), top_p=0.9, profile=profile,
                               sampled=torch.zeros(N, dtype=torch.int64))
    return mask.logprobs


def test_profile_flag_changes_the_support_and_names_it(tmp_path):
    path = dump(tmp_path)
    for profile, size in (("exact", 5), ("vllm", 4), ("sglang", 4), ("hf", 4)):
        out = tmp_path / f"{profile}.safetensors"
        result = run("capture", path, "-o", out, "--profile", profile)
        assert result.exit_code == 0, result.output
        mask = SamplingMask.load(out)
        assert mask.lengths().tolist() == [size] * N
        assert mask.metadata["semantics"] == semantics(profile)
    assert SamplingMask.load(tmp_path / "vllm.safetensors").token_ids[:4].tolist() == [0, 1, 3, 4]
    assert SamplingMask.load(tmp_path / "sglang.safetensors").token_ids[:4].tolist() == [0, 1, 2, 3]


def test_engine_logprobs_from_another_support_are_reported(tmp_path):
    # the engine (vLLM) sampled from 4 tokens; capture with the exact profile keeps 5
    rows = torch.arange(N)
    lp = engine_logprobs("vllm")
    path = dump(tmp_path, rollout_logprobs=lp)
    out = tmp_path / "m.safetensors"
    result = run("capture", path, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"{N} of {N} rows" in result.stderr and CAUSES[1].split(":")[0] in result.stderr
    mask = SamplingMask.load(out)
    assert mask.extras["logprob_mismatch"].tolist() == [1] * N
    report = json.loads(mask.metadata["logprob_mismatch"])
    assert report["rows"] == N and report["worst_row"] in rows.tolist()
    # with the engine's profile the same dump agrees: no report, codes all 0
    result = run("capture", path, "-o", out, "--profile", "vllm")
    assert result.exit_code == 0 and "rollout_logprobs" not in result.stderr
    mask = SamplingMask.load(out)
    assert mask.extras["logprob_mismatch"].tolist() == [0] * N
    assert json.loads(mask.metadata["logprob_mismatch"])["rows"] == 0


def test_sglang_rollout_captured_with_vllm_profile_is_a_larger_support(tmp_path):
    # z = [0, -.3, -.6] + 200 x [-3.5], top_p .7, min_p .05: SGLang keeps {0,1,2}, vLLM {0,1}
    z = torch.cat([torch.tensor([0.0, -0.3, -0.6]), torch.full((200,), -3.5)]).repeat(4, 1)
    sampled = torch.zeros(4, dtype=torch.int64)
    lp = mask_replay.capture(z, top_p=0.7, min_p=0.05, sampled=sampled, profile="sglang").logprobs
    path = tmp_path / "r.safetensors"
    save_file({"logits": z, "sampled": sampled, "top_p": torch.tensor(0.7), "min_p": torch.tensor(0.05),
               "rollout_logprobs": lp}, str(path))
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out, "--profile", "vllm").exit_code == 0
    assert SamplingMask.load(out).extras["logprob_mismatch"].tolist() == [2] * 4
    assert run("capture", path, "-o", out, "--profile", "sglang").exit_code == 0
    assert SamplingMask.load(out).extras["logprob_mismatch"].tolist() == [0] * 4


def test_raw_engine_logprobs_are_recognised(tmp_path):
    z = TIE_ROW.repeat(N, 1)
    raw = torch.log_softmax(z, 1)[:, 0]  # vLLM's default logprobs_mode: before any processing
    path = dump(tmp_path, rollout_logprobs=raw)
    out = tmp_path / "m.safetensors"
    result = run("capture", path, "-o", out, "--profile", "vllm")
    assert result.exit_code == 0
    assert "raw log-probs" in result.stderr
    assert SamplingMask.load(out).extras["logprob_mismatch"].tolist() == [3] * N


def test_tolerance_flag_and_mixed_inputs(tmp_path):
    a = dump(tmp_path, "a.safetensors", rollout_logprobs=engine_logprobs("vllm"))
    b = dump(tmp_path, "b.safetensors")
    out = tmp_path / "m.safetensors"
    # a tolerance above the gap (about 0.08 nats here) reports nothing
    result = run("capture", a, b, "-o", out, "--logprob-tol", "1")
    assert result.exit_code == 0 and "rollout_logprobs" not in result.stderr
    codes = SamplingMask.load(out).extras["logprob_mismatch"].tolist()
    assert codes == [0] * N + [-1] * N  # the second dump has nothing to compare


def test_bad_profile_and_tolerance_are_one_line_errors(tmp_path):
    path = dump(tmp_path)
    out = tmp_path / "m.safetensors"
    for args in (("--profile", "trtllm"), ("--logprob-tol", "-1"), ("--logprob-tol", "x")):
        result = run("capture", path, "-o", out, *args)
        assert result.exit_code != 0
        assert "Traceback" not in result.output
        assert args[0] in result.stderr
    assert not out.exists()


def test_resume_recomputes_a_mismatch_report_made_with_another_tolerance(tmp_path):
    """Regression: --resume compared inputs, parameters, --outside and the profile, but not
    --logprob-tol, so a file whose per-row logprob_mismatch codes were made with another tolerance
    was kept."""
    from tests.helpers import rollout_tensors, run, write

    t = rollout_tensors()
    mask = mask_replay.capture(t["logits"], sampled=t["sampled"], top_p=t["top_p"])
    t["rollout_logprobs"] = mask.logprobs + 1e-3  # off by 1e-3 nats: a mismatch at 1e-4, not at 1e-2
    dump, out = write(tmp_path / "lp.safetensors", t), tmp_path / "m.safetensors"
    args = ["capture", dump, "-o", out, "--resume"]
    assert run(*args).exit_code == 0
    assert set(SamplingMask.load(out).extras["logprob_mismatch"].tolist()) == {1}
    assert "skipped" in run(*args).stderr  # same command: kept
    again = run(*args, "--logprob-tol", "0.01")
    assert again.exit_code == 0 and "skipped" not in again.stderr
    assert set(SamplingMask.load(out).extras["logprob_mismatch"].tolist()) == {0}
    assert "skipped" in run(*args, "--logprob-tol", "0.01").stderr
