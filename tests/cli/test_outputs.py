"""Issue 9 §2: outputs never destroy what the user did not ask to overwrite.

Symlinks are followed and the real file replaced atomically; devices and FIFOs are written in
place (a test never touches the real /dev/null: device nodes are made in tmp_path); an output that
is an input or another output is refused before anything is read."""
import json
import os
import stat
import threading

import pytest

from mask_replay import SamplingMask
from tests.helpers import N, assert_clean, assert_one_line_error, rollout_tensors, run, write


@pytest.fixture
def training(tmp_path):
    return write(tmp_path / "t.safetensors", {"logits": rollout_tensors()["logits"]})


def _read_fifo_in_background(path):
    got = {}

    def reader():
        with open(path, "rb") as f:
            got["bytes"] = f.read()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t, got


# ---- symlinks -----------------------------------------------------------------------------------
def test_symlinked_output_keeps_the_link_and_replaces_its_target(tmp_path, rollout):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "m.safetensors"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    result = run("capture", rollout, "-o", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert SamplingMask.load(target).num_rows == N
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the replaced file keeps its permissions
    assert_clean(tmp_path)
    assert_clean(tmp_path / "real")


def test_dangling_symlink_output_creates_its_target(tmp_path, rollout):
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "new.safetensors")
    assert run("capture", rollout, "-o", link).exit_code == 0
    assert link.is_symlink()
    assert SamplingMask.load(tmp_path / "new.safetensors").num_rows == N


# ---- devices, FIFOs, stdout ---------------------------------------------------------------------
def test_fifo_output_is_streamed_not_replaced(tmp_path, rollout, captured, training):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    thread, got = _read_fifo_in_background(fifo)
    result = run("capture", rollout, "-o", fifo)
    thread.join(10)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got["bytes"] == open(captured, "rb").read()

    thread, got = _read_fifo_in_background(fifo)
    result = run("score", "--masks", captured, "--training", training, "--json", fifo)
    thread.join(10)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got["bytes"])["tokens"] == N


def _null_device(tmp_path):
    """A character device like /dev/null, made in tmp_path (needs root; skips otherwise)."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with open(node, "wb") as f:
            f.write(b"x")
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    return node


def test_device_outputs_stay_devices(tmp_path, rollout, captured, training):
    null = _null_device(tmp_path)
    link = tmp_path / "to_null"
    link.symlink_to(null)  # like /dev/stdout -> /proc/self/fd/1
    for out in (null, link):
        assert run("capture", rollout, "-o", out).exit_code == 0
        result = run("score", "--masks", captured, "--training", training, "--json", out, "--plot", out)
        assert result.exit_code == 0, result.output
        assert stat.S_ISCHR(os.stat(null).st_mode)
    assert link.is_symlink()
    assert_clean(tmp_path)


def test_json_dash_is_stdout(tmp_path, captured, training):
    result = run("score", "--masks", captured, "--training", training, "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == N  # stdout holds the JSON only
    assert "importance ratio mean" in result.stderr  # the table went to stderr
    assert not os.path.exists("-")


# ---- an output that is an input or another output ---------------------------------------------
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_score_refuses_to_overwrite_its_inputs(tmp_path, captured, training, how):
    def alias(path, name):
        if how == "same":
            return path
        p = tmp_path / name
        (p.symlink_to if how == "symlink" else p.hardlink_to)(path)
        return str(p)

    before = {p: open(p, "rb").read() for p in (captured, training)}
    cases = [
        (["--json", alias(training, "a")], ["--json", "--training"]),
        (["--plot", alias(captured, "b")], ["--plot", "--masks"]),
    ]
    for extra, needles in cases:
        result = run("score", "--masks", captured, "--training", training, *extra)
        assert_one_line_error(result, *needles)
    for p, data in before.items():
        assert open(p, "rb").read() == data


def test_score_refuses_json_and_plot_on_one_file(tmp_path, captured, training):
    out = tmp_path / "both"
    result = run("score", "--masks", captured, "--training", training, "--json", out, "--plot", out)
    assert_one_line_error(result, "--plot", "--json", "same file")
    assert not out.exists()
    link = tmp_path / "link"
    link.symlink_to(out)
    result = run("score", "--masks", captured, "--training", training, "--json", out, "--plot", link)
    assert_one_line_error(result, "same file")


def test_capture_refuses_an_input_through_a_link(tmp_path, rollout):
    link = tmp_path / "alias.safetensors"
    link.symlink_to(rollout)
    before = open(rollout, "rb").read()
    assert_one_line_error(run("capture", rollout, "-o", link), "would overwrite the input")
    assert open(rollout, "rb").read() == before


def test_plot_dash_is_refused(tmp_path, captured, training):
    assert_one_line_error(run("score", "--masks", captured, "--training", training, "--plot", "-"), "--plot")


# ---- demo --out ---------------------------------------------------------------------------------
def test_demo_creates_only_the_last_folder(tmp_path):
    out = tmp_path / "a" / "b" / "c"
    result = run("demo", "--out", out, "--vocab", 64, "--steps", 1, "--tokens-per-step", 4)
    assert_one_line_error(result, str(tmp_path / "a" / "b"), "does not exist")
    assert not (tmp_path / "a").exists()
    (tmp_path / "afile").write_text("x")
    result = run("demo", "--out", tmp_path / "afile", "--vocab", 64, "--steps", 1, "--tokens-per-step", 4)
    assert_one_line_error(result, "afile", "is a file")
    assert (tmp_path / "afile").read_text() == "x"


def test_demo_makes_its_folder_when_the_parent_exists(tmp_path):
    out = tmp_path / "new"
    result = run("demo", "--out", out, "--vocab", 64, "--steps", 2, "--tokens-per-step", 16)
    assert result.exit_code == 0, result.output
    assert (out / "masks.safetensors").exists() and (out / "score.json").exists()


def test_capture_to_dash_is_refused(tmp_path, rollout):
    assert_one_line_error(run("capture", rollout, "-o", "-"), "-o -")
    assert not os.path.exists("-")
