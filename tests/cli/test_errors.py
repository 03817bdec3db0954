"""Issue 9 §3: one clear line, exit != 0, never a traceback; each message recorded here."""
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import N, assert_clean, assert_one_line_error, restore_ctrl_c, rollout_tensors, run, write


@pytest.fixture
def training(tmp_path):
    return write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})


def rewrite_mask(path, out, **changes):
    """A copy of mask file `path` with keys replaced (None drops), metadata entries via meta=."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    meta.update(changes.pop("meta", {}))
    for k, v in changes.items():
        if v is None:
            tensors.pop(k, None)
        else:
            tensors[k] = v
    save_file(tensors, str(out), metadata=meta)
    return str(out)


# ---- flags: checked before any file is opened, errors name the flag ------------------------------
@pytest.mark.parametrize("flag,value,needle", [
    ("--top-k", str(2 ** 70), "--top-k"),
    ("--top-k", str(2 ** 63), "--top-k"),
    ("--temperature", "1e39", "--temperature 1e+39: must be a finite number"),
    ("--temperature", "nan", "--temperature nan"),
    ("--temperature", "inf", "--temperature inf"),
    ("--temperature", "-1", "--temperature -1.0: must be >= 0"),
    ("--temperature", "1e-46", "rounds to 0 in float32"),
    ("--top-p", "nan", "--top-p nan: must be in (0, 1]"),
    ("--top-p", "0", "--top-p 0.0"),
    ("--top-p", "1.5", "--top-p 1.5"),
    ("--min-p", "nan", "--min-p nan: must be in [0, 1]"),
    ("--min-p", "-0.1", "--min-p -0.1"),
    ("--logprob-tol", "nan", "--logprob-tol nan: must be a number >= 0"),  # was a traceback mid-capture
])
def test_capture_flags_checked_first(tmp_path, flag, value, needle):
    # the dump does not exist: the flag must be blamed, before any file is opened
    result = run("capture", tmp_path / "missing.safetensors", "-o", tmp_path / "m.safetensors", flag, value)
    assert_one_line_error(result, needle)
    assert "missing.safetensors" not in result.stderr and "logits" not in result.stderr


@pytest.mark.parametrize("flag,value,needle", [
    ("--top-p", "nan", "--top-p nan"), ("--temperature", "nan", "--temperature nan"),
    ("--temperature", "0", "--temperature 0.0: must be > 0"), ("--temperature", "1e-46", "rounds to 0"),
])
def test_demo_flags_checked_first(tmp_path, flag, value, needle):
    assert_one_line_error(run("demo", "--out", tmp_path / "d", flag, value), needle)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("device,needle", [
    ("bogus", "--device bogus: not a device name"),
    ("meta", "--device meta: only cpu and cuda are supported"),
    ("cuda:99", "--device cuda:99"),
])
@pytest.mark.parametrize("cmd", ["capture", "score"])
def test_bad_device_is_one_line(tmp_path, rollout, captured, training, device, needle, cmd):
    args = ([rollout, "-o", tmp_path / "x.safetensors"] if cmd == "capture"
            else ["--masks", captured, "--training", training])
    assert_one_line_error(run(cmd, *args, "--device", device), needle)


def test_usage_errors_are_one_line(tmp_path):
    assert_one_line_error(run("capture", "--top-k", "many"), "--top-k")
    assert_one_line_error(run("score", "--masks"), "--masks")
    assert_one_line_error(run("nosuchcommand"), "nosuchcommand")


# ---- full disk ----------------------------------------------------------------------------------
def _full_disk_after(monkeypatch, writes_ok):
    from mask_replay.files import safetensors_stream

    real, calls = safetensors_stream.StreamWriter._pwrite, []

    def pwrite(self, pos, t):
        calls.append(pos)
        if len(calls) > writes_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, pos, t)

    monkeypatch.setattr(safetensors_stream.StreamWriter, "_pwrite", pwrite)


def test_full_disk_during_demo_names_the_file(tmp_path, monkeypatch):
    _full_disk_after(monkeypatch, 2)
    out = tmp_path / "d"
    result = run("demo", "--out", out, "--vocab", 64, "--steps", 1, "--tokens-per-step", 8)
    assert_one_line_error(result, str(out / "rollout.safetensors"), "No space left on device")
    assert_clean(out, "rollout.safetensors")


# ---- malformed mask files in score --------------------------------------------------------------
@pytest.mark.parametrize("key,value,needle", [
    ("sampled", lambda m: m.float(), "key 'sampled': must be an integer tensor, got float32"),
    ("step", lambda m: torch.full((N,), float("nan")), "key 'step': must be an integer tensor, got float32"),
    ("step", lambda m: torch.full((N,), 1.5), "key 'step': must be an integer tensor"),
    ("logprobs", lambda m: m.long() * 0, "key 'logprobs': must be a float tensor, got int64"),
    ("outside_support", lambda m: torch.zeros(N, dtype=torch.int64), "key 'outside_support': must be a bool"),
])
def test_score_refuses_mistyped_mask_keys(tmp_path, captured, training, key, value, needle):
    from safetensors import safe_open

    with safe_open(captured, framework="pt") as f:
        base = f.get_tensor("sampled")
    bad = rewrite_mask(captured, tmp_path / "bad.safetensors", **{key: value(base)})
    assert_one_line_error(run("score", "--masks", bad, "--training", training), "bad.safetensors", needle)


@pytest.mark.parametrize("t", [-1.0, float("nan"), float("inf")])
def test_score_refuses_a_bad_temperature_row(tmp_path, captured, training, t):
    temp = torch.ones(N)
    temp[7] = t
    bad = rewrite_mask(captured, tmp_path / "bad.safetensors", temperature=temp)
    assert_one_line_error(run("score", "--masks", bad, "--training", training),
                          "key 'temperature'", "at row 7", "finite value >= 0")


def test_score_refuses_a_non_integer_vocab_size(tmp_path, captured, training):
    bad = rewrite_mask(captured, tmp_path / "bad.safetensors", meta={"vocab_size": "abc"})
    assert_one_line_error(run("score", "--masks", bad, "--training", training),
                          "metadata 'vocab_size': not an integer ('abc')")


def test_inspect_zero_dim_offsets(tmp_path):
    path = write(tmp_path / "m.safetensors", {"token_ids": torch.zeros(3, dtype=torch.int32),
                                              "offsets": torch.tensor(0, dtype=torch.int64)})
    result = run("inspect", path)
    assert_one_line_error(result, "key 'offsets'", "1-D int64")
    assert "token_ids" in result.stdout  # what could be read is still shown


# ---- wording ------------------------------------------------------------------------------------
def test_outside_support_error_names_the_cli_flag(tmp_path):
    t = rollout_tensors()
    t["sampled"][5] = torch.argmin(t["logits"][5])
    path = write(tmp_path / "r.safetensors", t)
    result = run("capture", path, "-o", tmp_path / "m.safetensors")
    assert_one_line_error(result, "row 5", "use --outside flag")
    assert "outside='flag'" not in result.stderr


@pytest.mark.parametrize("rows", [[5], [5, 9]])
def test_score_note_says_rows_were_flagged(tmp_path, training, rows):
    t = rollout_tensors()
    for r in rows:
        t["sampled"][r] = torch.argmin(t["logits"][r])
    path = write(tmp_path / "r.safetensors", t)
    masks = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", masks, "--outside", "flag").exit_code == 0
    result = run("score", "--masks", masks, "--training", training, "--json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    word = "1 row flagged" if len(rows) == 1 else f"{len(rows)} rows flagged"
    assert f"note: {word} by capture (--outside flag" in result.stderr, result.stderr
    assert "first row 5" in result.stderr
    assert "without a finite rollout log-prob" not in result.stderr
    assert json.loads((tmp_path / "s.json").read_text())["tokens"] == N - len(rows)


# ---- -inf training logit at the sampled token: strict JSON, rows reported -----------------------
def _strict_loads(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def test_minus_inf_training_logit_is_reported_and_json_stays_strict(tmp_path, captured):
    z = rollout_tensors()["logits"].clone()
    rows = [3, 11]
    for r in rows:
        z[r, int(torch.argmax(z[r]))] = float("-inf")
    training = write(tmp_path / "t.safetensors", {"logits": z})
    js = tmp_path / "s.json"
    result = run("score", "--masks", captured, "--training", training, "--json", js)
    assert result.exit_code == 0, result.output
    assert "2 rows with a -inf training log-prob" in result.stderr and "first row 3" in result.stderr
    assert "Warning" not in result.stderr
    report = _strict_loads(js.read_text())
    assert report["tokens"] == N - 2
    assert math.isfinite(report["no_replay"]["importance_ratio_mean"])


def test_no_scorable_rows_gives_nulls_not_nan(tmp_path, captured):
    z = rollout_tensors()["logits"].clone()
    z[torch.arange(N), torch.argmax(z, 1)] = float("-inf")
    training = write(tmp_path / "t.safetensors", {"logits": z})
    js = tmp_path / "s.json"
    result = run("score", "--masks", captured, "--training", training, "--json", js)
    assert result.exit_code == 0, result.output
    assert "Warning" not in result.stderr
    report = _strict_loads(js.read_text())
    assert report["tokens"] == 0 and report["replay"]["importance_ratio_mean"] is None


def test_report_json_refuses_nan_by_construction():
    from mask_replay.tools.score import report_json

    text = report_json({"a": float("nan"), "b": {"c": float("inf"), "d": 1.5}})
    assert _strict_loads(text) == {"a": None, "b": {"c": None, "d": 1.5}}


# ---- Ctrl-C -------------------------------------------------------------------------------------
def test_ctrl_c_during_a_command_is_one_line_130(tmp_path, rollout, monkeypatch):
    import mask_replay.tools.capture as cd

    real = cd._capture_chunk

    def interrupted(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(cd, "_capture_chunk", interrupted)
    result = run("capture", rollout, "-o", tmp_path / "m.safetensors")
    assert result.exit_code == 130
    assert_one_line_error(result, "interrupted")
    assert_clean(tmp_path, "m.safetensors")


def _wait_until_torch_loads(proc, timeout=60.0):
    """Until the child maps torch's core library: it is then inside the start-up window (the
    package installs its Ctrl-C hook before it imports torch, and torch takes a second or more to
    import). Deterministic, unlike a sleep racing the start-up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                if "libc10" in f.read():
                    return
        except FileNotFoundError:
            pytest.fail(f"the command exited ({proc.wait()}) before loading torch")
        time.sleep(0.002)
    pytest.fail("torch was not loaded within the timeout")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see the start-up window")
@pytest.mark.parametrize("entry", ["script", "module"])
def test_ctrl_c_during_start_up_is_one_line_130(entry, tmp_path):
    """SIGINT while torch is still being imported: one line, status 130, no traceback. The command
    then blocks opening a FIFO nobody writes to, so that there is no way for it to finish (exit 0)
    before the signal lands: whether the start-up hook or the command's own handler takes it, the
    answer must be the same."""
    script = os.path.join(os.path.dirname(sys.executable), "mask-replay")
    if entry == "script" and not os.path.exists(script):
        pytest.skip("console script not installed in this environment")
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    cmd = [script, "inspect", str(fifo)] if entry == "script" else [sys.executable, "-m", "mask_replay", "inspect",
                                                                     str(fifo)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=restore_ctrl_c)
    try:
        _wait_until_torch_loads(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["mask-replay: error: interrupted"], err


@pytest.mark.slow  # a subprocess / an end-to-end run: seconds
def test_start_up_hook_turns_ctrl_c_into_one_line_130():
    """The hook itself, exercised directly in a child that raises KeyboardInterrupt at once."""
    code = ("import sys; sys.argv[0] = 'mask-replay'\n"
            "import mask_replay._startup\n"
            "raise KeyboardInterrupt\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 130, out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.strip()] == ["mask-replay: error: interrupted"]


@pytest.mark.slow  # a subprocess / an end-to-end run: seconds
def test_library_users_keep_pythons_own_ctrl_c():
    code = "import mask_replay, sys; print(sys.excepthook is sys.__excepthook__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", out.stderr


# ---- score reads the mask in chunks: whole-file checks at open, ids checked per chunk ------------
@pytest.mark.parametrize("damage,needle", [
    ("decrease", "offsets decrease at row 9"),
    ("end", "offsets[-1] ="),
    ("start", "offsets[0] must be 0"),
    ("short_key", "kept_mass must have shape [24]"),
    ("id_range", "token_ids of row 17 hold an id outside [0, 40)"),
    ("order", "token_ids of row 17 are not strictly ascending"),
])
def test_score_checks_the_mask_file_naming_absolute_rows(tmp_path, captured, training, damage, needle):
    from safetensors import safe_open

    with safe_open(captured, framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    o, ids = t["offsets"].clone(), t["token_ids"].clone()
    if damage == "decrease":
        o[10] = o[9] - 1
    elif damage == "end":
        o[-1] += 1
    elif damage == "start":
        o[0] = 1
    elif damage == "short_key":
        t["kept_mass"] = t["kept_mass"][:-1]
    elif damage == "id_range":
        ids[int(o[17])] = 40
    else:
        row = next(r for r in range(17, N) if o[r + 1] - o[r] >= 2)
        assert row == 17, "fixture changed: pick another row"
        ids[int(o[17])], ids[int(o[17]) + 1] = ids[int(o[17]) + 1].clone(), ids[int(o[17])].clone()
    t["offsets"], t["token_ids"] = o, ids
    bad = write(tmp_path / "bad.safetensors", t)
    result = run("score", "--masks", bad, "--training", training, "--chunk-rows", 5)
    assert_one_line_error(result, "bad.safetensors", needle)
