"""The mask-replay command line, end to end on small dumps (click's CliRunner, files in tmp_path)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import mask_replay
from mask_replay import SamplingMask
from tests.helpers import (
    TOP_P,
    N,
    V,
    assert_clean,
    assert_one_line_error,
    make_logits,
    rollout_tensors,
    run,
    write,
    write_dump,
)


@pytest.mark.parametrize("cmd", [[], ["capture"], ["score"], ["inspect"], ["demo"], ["info"]])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_everywhere(cmd, flag):
    result = run(*cmd, flag)
    assert result.exit_code == 0
    assert "Usage: " in result.output


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert mask_replay.__version__ in result.output


@pytest.mark.slow  # a subprocess / an end-to-end run: seconds
def test_python_m_runs_the_cli():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mask_replay", "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "capture" in proc.stdout and "score" in proc.stdout


def test_info_names_build_and_versions():
    result = run("info")
    assert result.exit_code == 0
    assert f"torch {torch.__version__}" in result.output
    assert "build cpu: True" in result.output


# ---- capture ------------------------------------------------------------------------------------
def test_capture_writes_a_mask_file_with_carried_keys(tmp_path, rollout):
    out = tmp_path / "masks.safetensors"
    result = run("capture", rollout, "-o", out)
    assert result.exit_code == 0, result.output
    assert "singleton share" in result.output
    mask = SamplingMask.load(out)
    assert mask.num_rows == N
    z = rollout_tensors()["logits"]
    ref = mask_replay.capture(z, top_p=TOP_P, sampled=torch.argmax(z, 1))
    assert torch.equal(mask.token_ids, ref.token_ids) and torch.equal(mask.offsets, ref.offsets)
    # no rollout_logprobs in the dump: logprobs are the computed ones, kept under both names
    torch.testing.assert_close(mask.logprobs, ref.logprobs)
    torch.testing.assert_close(mask.extras["capture_logprobs"], ref.logprobs)
    assert torch.equal(mask.extras["step"], torch.arange(N) // 8)
    assert torch.equal(mask.extras["sequence"], (torch.arange(N) % 8) // 4)
    assert torch.equal(mask.extras["temperature"], torch.ones(N))
    meta = mask.metadata
    assert json.loads(meta["sources"]) == ["rollout.safetensors"]
    assert json.loads(meta["params"])["rollout.safetensors"]["top_p"] == "dump"
    assert meta["mask_replay_version"] == mask_replay.__version__ and "semantics" in meta


def test_capture_uses_engine_logprobs_when_present(tmp_path):
    engine = torch.full((N,), -0.25)
    path = write(tmp_path / "r.safetensors", rollout_tensors(rollout_logprobs=engine))
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out).exit_code == 0
    mask = SamplingMask.load(out)
    assert torch.equal(mask.logprobs, engine)
    assert not torch.equal(mask.extras["capture_logprobs"], engine)


def test_explicit_flag_overrides_dump_and_default_fills_in(tmp_path, rollout):
    out = tmp_path / "m.safetensors"
    assert run("capture", rollout, "-o", out, "--top-p", "1.0").exit_code == 0
    assert torch.equal(SamplingMask.load(out).lengths(), torch.full((N,), V))  # top-p off: whole vocab
    # the dump has no top_k: the flag fills it in (and top_p still comes from the dump)
    assert run("capture", rollout, "-o", out, "--top-k", "1").exit_code == 0
    mask = SamplingMask.load(out)
    assert torch.equal(mask.lengths(), torch.ones(N, dtype=torch.int64))
    params = json.loads(mask.metadata["params"])["rollout.safetensors"]
    assert params["top_k"] == {"source": "flag", "value": 1} and params["top_p"] == "dump"
    # not given on the command line: the dump's top_p is used, same as with no flag at all
    z = rollout_tensors()["logits"]
    assert run("capture", rollout, "-o", out).exit_code == 0
    assert torch.equal(SamplingMask.load(out).token_ids, mask_replay.capture(z, top_p=TOP_P).token_ids)


def test_per_row_parameters_from_the_dump(tmp_path):
    temps = torch.linspace(0.5, 1.5, N)
    path = write(tmp_path / "r.safetensors", rollout_tensors(temperature=temps, top_k=torch.full((N,), 3)))
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out).exit_code == 0
    mask = SamplingMask.load(out)
    assert torch.equal(mask.extras["temperature"], temps)
    z = rollout_tensors()["logits"]
    ref = mask_replay.capture(z, temperature=temps, top_k=3, top_p=TOP_P)
    assert torch.equal(mask.token_ids, ref.token_ids)


def test_several_inputs_concatenate_in_order_and_chunks_do_not_matter(tmp_path):
    a = write(tmp_path / "a.safetensors", rollout_tensors(seed=1))
    b = write(tmp_path / "b.safetensors", rollout_tensors(n=10, seed=2))
    one, many = tmp_path / "one.safetensors", tmp_path / "many.safetensors"
    assert run("capture", a, b, "-o", one).exit_code == 0
    assert run("capture", a, b, "-o", many, "--chunk-rows", "7").exit_code == 0
    m1, m2 = SamplingMask.load(one), SamplingMask.load(many)
    assert m1 == m2
    assert m1.num_rows == N + 10
    want = torch.cat([rollout_tensors(seed=1)["sampled"], rollout_tensors(n=10, seed=2)["sampled"]])
    assert torch.equal(m1.sampled, want)
    assert json.loads(m1.metadata["sources"]) == ["a.safetensors", "b.safetensors"]


@pytest.mark.parametrize("fmt", ["pt", "npz"])
def test_pt_and_npz_dumps_match_safetensors(tmp_path, rollout, fmt):
    path = write_dump(tmp_path / f"r.{fmt}", rollout_tensors())
    ref, out = tmp_path / "ref.safetensors", tmp_path / f"out_{fmt}.safetensors"
    assert run("capture", rollout, "-o", ref).exit_code == 0
    result = run("capture", path, "-o", out)
    assert result.exit_code == 0, result.output
    assert SamplingMask.load(ref) == SamplingMask.load(out)


def test_bf16_logits(tmp_path):
    t = rollout_tensors()
    t["logits"] = t["logits"].to(torch.bfloat16)
    t["sampled"] = torch.argmax(t["logits"].float(), 1)
    path = write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out).exit_code == 0
    assert SamplingMask.load(out).num_rows == N


def test_outside_flag_records_rows(tmp_path):
    t = rollout_tensors()
    t["sampled"][5] = torch.argmin(t["logits"][5])  # lowest logit: outside top-p 0.8
    path = write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    result = run("capture", path, "-o", out, "--outside", "flag")
    assert result.exit_code == 0, result.output
    flags = SamplingMask.load(out).extras["outside_support"]
    assert torch.equal(torch.nonzero(flags).flatten(), torch.tensor([5]))


# ---- score, plot, inspect -----------------------------------------------------------------------
def test_score_json_table_and_plot(tmp_path, rollout):
    masks = tmp_path / "m.safetensors"
    assert run("capture", rollout, "-o", masks).exit_code == 0
    training = write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    result = run("score", "--masks", masks, "--training", training, "--json", js, "--plot", png)
    assert result.exit_code == 0, result.output
    assert "no replay" in result.output and "importance ratio mean" in result.output
    report = json.loads(js.read_text())
    assert list(report) == ["tokens", "kept_mass_mean", "replay", "no_replay", "per_step", "inputs"]
    assert report["tokens"] == N
    mask = SamplingMask.load(masks)
    # identical logits: replay reproduces the rollout log-prob; no replay is off by the kept mass
    assert report["replay"]["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert report["replay"]["kl_k3"] == pytest.approx(0.0, abs=1e-5)
    kept = float(mask.kept_mass.double().mean())
    assert report["no_replay"]["importance_ratio_mean"] == pytest.approx(kept, rel=1e-4)
    assert report["kept_mass_mean"] == pytest.approx(float(mask.kept_mass.double().mean()), rel=1e-6)
    assert report["no_replay"]["logp_diff_mean"] < 0
    assert sorted(report["per_step"]) == ["0", "1", "2"]
    assert report["per_step"]["1"]["tokens"] == 8
    assert report["replay"]["sequences"] == 6  # (step, sequence) pairs
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_score_metrics_by_hand():
    from mask_replay.trainer.metrics import build_report

    rollout = np.log(np.array([0.5, 0.5, 0.25, 0.25]))
    training = np.log(np.array([0.5, 0.25, 0.25, 0.5]))
    report = build_report(rollout, rollout.copy(), training, np.ones(4), step=np.array([0, 0, 1, 1]),
                          sequence=np.array([0, 0, 0, 0]))
    m = report["no_replay"]
    r = np.array([1.0, 0.5, 1.0, 2.0])
    assert m["importance_ratio_mean"] == pytest.approx(r.mean())
    assert m["importance_ratio_median"] == pytest.approx(1.0)
    assert m["kl_k1"] == pytest.approx(-np.log(r).mean())
    assert m["kl_k3"] == pytest.approx((r - 1 - np.log(r)).mean())
    assert m["chi2"] == pytest.approx((r ** 2).mean() - 1)
    assert m["frac_outside_0.9_1.1"] == pytest.approx(0.5)
    assert m["sequences"] == 2  # sequence 0 at step 0 and at step 1 are two sequences
    assert m["sequence_ratio_mean"] == pytest.approx((0.5 + 2.0) / 2)
    assert report["replay"]["kl_k3"] == 0.0
    assert report["per_step"]["1"]["no_replay"]["importance_ratio_mean"] == pytest.approx(1.5)


def test_inspect_mask_and_dump_without_reading_logits(tmp_path, rollout, monkeypatch):
    masks = tmp_path / "m.safetensors"
    assert run("capture", rollout, "-o", masks).exit_code == 0
    from mask_replay.files.dumps import Dump

    real_get = Dump.get

    def get(self, key, *a, **k):
        assert key != "logits", "inspect must not read the logits"
        return real_get(self, key, *a, **k)

    monkeypatch.setattr(Dump, "get", get)
    result = run("inspect", rollout)
    assert result.exit_code == 0, result.output
    assert "rollout dump" in result.output and "logits" in result.output and f"rows: {N}" in result.output
    result = run("inspect", masks)
    assert result.exit_code == 0, result.output
    assert "mask file" in result.output and "singleton share" in result.output


# ---- errors: one line naming file, key and row; no output left behind ----------------------------
def test_missing_key(tmp_path):
    t = rollout_tensors()
    del t["sampled"]
    path = write(tmp_path / "r.safetensors", t)
    result = run("capture", path, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "r.safetensors", "key 'sampled'", "missing")
    assert_clean(tmp_path, "m.safetensors")


@pytest.mark.parametrize("key,value,needle", [
    ("logits", torch.zeros(N, V, dtype=torch.int32), "float32, bfloat16 or float16"),
    ("logits", torch.zeros(N * V), "2-D"),
    ("sampled", torch.zeros(N, 1, dtype=torch.int64), "shape"),
    ("sampled", torch.zeros(N), "integer"),
    ("step", torch.zeros(N + 1, dtype=torch.int64), "shape"),
    ("top_p", torch.full((N - 1,), 0.5), "shape"),
])
def test_wrong_dtype_or_rank(tmp_path, key, value, needle):
    path = write(tmp_path / "r.safetensors", rollout_tensors(**{key: value}))
    result = run("capture", path, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "r.safetensors", f"key '{key}'", needle)
    assert_clean(tmp_path, "m.safetensors")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_name_the_absolute_row(tmp_path, bad):
    t = rollout_tensors()
    t["logits"][17, 3] = bad
    path = write(tmp_path / "r.safetensors", t)
    result = run("capture", path, "-o", tmp_path / "m.safetensors", "--chunk-rows", "5")
    assert_one_line_error(result, "r.safetensors", "key 'logits'", "row 17")
    assert_clean(tmp_path, "m.safetensors")


def test_sampled_out_of_range(tmp_path):
    t = rollout_tensors()
    t["sampled"][9] = V
    path = write(tmp_path / "r.safetensors", t)
    result = run("capture", path, "-o", tmp_path / "m.safetensors", "--chunk-rows", "4")
    assert_one_line_error(result, "r.safetensors", "key 'sampled'", "row 9", "out of range")
    assert_clean(tmp_path, "m.safetensors")


def test_sampled_outside_support(tmp_path):
    t = rollout_tensors()
    t["sampled"][13] = torch.argmin(t["logits"][13])
    path = write(tmp_path / "r.safetensors", t)
    result = run("capture", path, "-o", tmp_path / "m.safetensors", "--chunk-rows", "5")
    assert_one_line_error(result, "r.safetensors", "key 'sampled'", "row 13")
    assert_clean(tmp_path, "m.safetensors")


def test_vocab_mismatch_between_inputs(tmp_path):
    a = write(tmp_path / "a.safetensors", rollout_tensors())
    b = write(tmp_path / "b.safetensors", rollout_tensors(v=V + 1))
    result = run("capture", a, b, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "b.safetensors", "key 'logits'", "vocab size")
    assert_clean(tmp_path, "m.safetensors")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "missing"])
def test_truncated_or_corrupt_file(tmp_path, rollout, damage):
    data = open(rollout, "rb").read()
    if damage == "missing":
        os.unlink(rollout)
    else:
        with open(rollout, "wb") as f:
            f.write({"truncated": data[: len(data) // 2], "garbage": b"\x07" * 300, "empty": b""}[damage])
    result = run("capture", rollout, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "rollout.safetensors")
    assert_clean(tmp_path, "m.safetensors")


def test_unwritable_output(tmp_path, rollout):
    result = run("capture", rollout, "-o", tmp_path / "no_such_dir" / "m.safetensors")
    assert_one_line_error(result, "no_such_dir", "does not exist")
    (tmp_path / "adir").mkdir()
    result = run("capture", rollout, "-o", tmp_path / "adir")
    assert_one_line_error(result, "adir", "folder")
    assert_clean(tmp_path)


def test_failed_write_leaves_no_partial_file(tmp_path, rollout, monkeypatch):
    """A full disk mid-capture: one line naming the output file, no partial file, no temp file."""
    import errno

    from mask_replay.files import safetensors_stream

    real = safetensors_stream.StreamWriter._pwrite
    calls = []

    def full_disk(self, pos, t):
        calls.append(pos)
        if len(calls) > 3:  # some bytes went out first, as on a real disk filling up
            raise OSError(errno.ENOSPC, "No space left on device")  # no file name, as os.write gives
        return real(self, pos, t)

    monkeypatch.setattr(safetensors_stream.StreamWriter, "_pwrite", full_disk)
    out = tmp_path / "m.safetensors"
    result = run("capture", rollout, "-o", out)
    assert_one_line_error(result, "No space left on device", str(out))
    assert_clean(tmp_path, "m.safetensors")



def test_score_row_count_mismatch(tmp_path, captured):
    training = write(tmp_path / "t.safetensors", {"logits": make_logits(n=N - 1)})
    result = run("score", "--masks", captured, "--training", training, "--json", tmp_path / "s.json")
    assert_one_line_error(result, "t.safetensors", "key 'logits'", f"{N - 1} rows", str(N))
    assert_clean(tmp_path, "s.json")


def test_score_vocab_mismatch(tmp_path, captured):
    training = write(tmp_path / "t.safetensors", {"logits": make_logits(v=V + 3)})
    result = run("score", "--masks", captured, "--training", training, "--json", tmp_path / "s.json")
    assert_one_line_error(result, "t.safetensors", "key 'logits'", "vocab size")
    assert_clean(tmp_path, "s.json")


def test_score_nan_training_logits(tmp_path, captured):
    z = make_logits()
    z[11, 0] = float("nan")
    training = write(tmp_path / "t.safetensors", {"logits": z})
    result = run("score", "--masks", captured, "--training", training, "--chunk-rows", "4",
                 "--json", tmp_path / "s.json", "--plot", tmp_path / "s.png")
    assert_one_line_error(result, "t.safetensors", "key 'logits'", "NaN", "row 11")
    assert_clean(tmp_path, "s.json", "s.png")


def test_score_sampled_outside_recorded_support(tmp_path, captured):
    tensors = load_file(str(captured))
    lengths = tensors["offsets"][1:] - tensors["offsets"][:-1]
    row = int(torch.nonzero(lengths < V)[-1])
    ids = set(tensors["token_ids"][tensors["offsets"][row]: tensors["offsets"][row + 1]].tolist())
    tensors["sampled"][row] = next(i for i in range(V) if i not in ids)
    bad = write(tmp_path / "bad.safetensors", tensors)
    training = write(tmp_path / "t.safetensors", {"logits": make_logits()})
    result = run("score", "--masks", bad, "--training", training, "--chunk-rows", "5")
    assert_one_line_error(result, "bad.safetensors", "key 'sampled'", f"row {row}", "--outside flag")
    assert "fallback=True" not in result.stderr


def test_score_mask_file_missing_key(tmp_path):
    path = write(tmp_path / "m.safetensors", {"offsets": torch.zeros(1, dtype=torch.int64)})
    training = write(tmp_path / "t.safetensors", {"logits": make_logits(n=0)})
    result = run("score", "--masks", path, "--training", training)
    assert_one_line_error(result, "m.safetensors", "token_ids")


def test_inspect_corrupt_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(run("inspect", path), "x.safetensors")


# ---- demo ---------------------------------------------------------------------------------------
def test_demo_shows_the_replay_effect(tmp_path):
    out = tmp_path / "demo"
    result = run("demo", "--out", out, "--vocab", "4096", "--steps", "3", "--tokens-per-step", "64")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "score.json").read_text())
    rep, full = report["replay"], report["no_replay"]
    assert full["importance_ratio_mean"] < 0.99
    assert full["importance_ratio_mean"] == pytest.approx(report["kept_mass_mean"], abs=0.02)
    assert full["logp_diff_mean"] < 0
    assert rep["importance_ratio_mean"] == pytest.approx(1.0, abs=0.01)
    assert rep["logp_diff_std"] < full["logp_diff_std"]
    assert rep["kl_k3"] < full["kl_k3"]
    for name in ("rollout.safetensors", "training.safetensors", "masks.safetensors", "score.png"):
        assert (out / name).exists()


@pytest.mark.parametrize("fmt", ["pt", "npz"])
def test_truncated_pt_and_npz(tmp_path, fmt):
    path = write_dump(tmp_path / f"r.{fmt}", rollout_tensors())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    result = run("capture", path, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, f"r.{fmt}", "not a readable")
    assert_clean(tmp_path, "m.safetensors")


def test_pt_dump_must_be_a_dict_of_tensors(tmp_path):
    path = tmp_path / "r.pt"
    torch.save([torch.zeros(2)], path)
    assert_one_line_error(run("capture", path, "-o", tmp_path / "m.safetensors"), "r.pt", "dict of tensors")


def test_check_finite_allows_minus_inf_entries_but_not_empty_rows(tmp_path):
    from mask_replay.errors import DumpError
    from mask_replay.files.dumps import Dump, check_finite

    z = make_logits().to(torch.float16) * 1000  # large fp16 values: row sums must not overflow
    z[3, :5] = float("-inf")  # masked padding is legal
    path = write(tmp_path / "t.safetensors", {"logits": z})
    with Dump(path) as d:
        check_finite(d, z, row0=100)
        z[6] = float("-inf")
        with pytest.raises(DumpError, match=r"t.safetensors: key 'logits': no finite entry at row 106"):
            check_finite(d, z, row0=100)


def test_score_leaves_greedy_rows_out(tmp_path):
    temps = torch.ones(N)
    temps[:4] = 0.0
    path = write(tmp_path / "r.safetensors", rollout_tensors(temperature=temps))
    masks = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", masks).exit_code == 0
    training = write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})
    js = tmp_path / "s.json"
    result = run("score", "--masks", masks, "--training", training, "--json", js)
    assert result.exit_code == 0, result.output
    assert "4 greedy rows" in result.stderr
    report = json.loads(js.read_text())
    assert report["tokens"] == N - 4
    assert report["replay"]["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_plot_needs_steps(tmp_path):
    t = rollout_tensors()
    del t["step"]
    path = write(tmp_path / "r.safetensors", t)
    masks = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", masks).exit_code == 0
    training = write(tmp_path / "t.safetensors", {"logits": t["logits"]})
    result = run("score", "--masks", masks, "--training", training, "--json", tmp_path / "s.json",
                 "--plot", tmp_path / "s.png")
    assert_one_line_error(result, "s.png", "no 'step' key")
    assert_clean(tmp_path, "s.json", "s.png")


@pytest.mark.slow  # a subprocess / an end-to-end run: seconds
def test_a_command_whose_optional_dependency_is_missing_is_one_line_and_listed():
    """Without transformers, `example` refuses in one line naming the extra (exit 1), writing nothing,
    and every other command still works: the example's module imports without the [hf] extra
    (tools/example.py), so it is listed as usual."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from mask_replay.cli.main import main\n"
            "main(sys.argv[1:], prog_name='mask-replay')\n")

    def run_it(*args):
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)

    out = run_it("example", "--out", "nowhere")
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "mask-replay: error: mask_replay.integrations.transformers needs transformers: "
        "pip install 'mask-replay[hf]'"]
    assert not os.path.exists("nowhere")
    listing = run_it("--help")
    assert listing.returncode == 0 and "example" in listing.stdout and "capture" in listing.stdout
