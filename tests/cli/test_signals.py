"""SIGTERM and SIGHUP (a scheduler's time-out, `timeout`, `docker stop`, a closed terminal) end any
command as Ctrl-C does: the partial temp file beside the output is removed, one line on stderr, exit
status 128 + N."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import restore_ctrl_c

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _big_rollout(path, rows=40000, vocab=256):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(rows, vocab, generator=g)
    save_file({"logits": z, "sampled": z.argmax(1)}, str(path))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_capture_leaves_no_temp_file(tmp_path, sig):
    _big_rollout(tmp_path / "r.safetensors")
    out = tmp_path / "m.safetensors"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mask_replay", "capture", str(tmp_path / "r.safetensors"), "-o",
                             str(out), "--chunk-rows", "8", "--top-p", "0.9"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not glob.glob(str(tmp_path / ".m.safetensors.*.tmp")):  # the capture is writing
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    _pause(proc)
    _deliver(proc, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"mask-replay: error: terminated by {sig.name} (unfinished outputs removed)"], err
    assert sorted(os.listdir(tmp_path)) == ["r.safetensors"]


def _score_inputs(tmp_path, rows=40000, vocab=256):
    """A mask file of a big rollout and a training dump a little off it; score runs for seconds at
    --chunk-rows 8, long enough to be interrupted."""
    _big_rollout(tmp_path / "r.safetensors", rows, vocab)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "mask_replay", "capture", "r.safetensors", "-o", "m.safetensors",
                    "--top-p", "0.9"], cwd=tmp_path, env=env, check=True, capture_output=True)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    save_file({"logits": z + 0.05 * torch.randn(rows, vocab, generator=g)}, str(tmp_path / "t.safetensors"))
    return env


def _score(tmp_path, env, js, *extra):
    return subprocess.Popen([sys.executable, "-m", "mask_replay", "score", "--masks", "m.safetensors", "--training",
                             "t.safetensors", "--json", js, "--chunk-rows", "8", *extra], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=restore_ctrl_c)


def _pause(proc):
    """SIGSTOP: the run cannot finish between this check and the signal the test sends next (a fast
    run did, and exited 0 before the signal landed)."""
    os.kill(proc.pid, signal.SIGSTOP)
    assert proc.poll() is None, proc.communicate()  # stopped mid-run, not finished


def _deliver(proc, sig):
    """The signal, then SIGCONT: it is handled as the run resumes, mid-run."""
    proc.send_signal(sig)
    os.kill(proc.pid, signal.SIGCONT)


def _mid_run(proc, opened="t.safetensors"):
    """Wait until the process has the training dump open (Linux /proc): past start-up, scoring; then
    pause it there (_pause)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        try:
            fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        except OSError:  # an fd closed between listdir and readlink
            fds = []
        if any(f.endswith(opened) for f in fds):
            break
        time.sleep(0.05)
    time.sleep(0.1)
    _pause(proc)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_score_keeps_the_existing_report(tmp_path, sig):
    env = _score_inputs(tmp_path)
    old = '{"an": "earlier report"}\n'
    (tmp_path / "s.json").write_text(old)
    proc = _score(tmp_path, env, "s.json")
    _mid_run(proc)
    _deliver(proc, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    said = "interrupted" if sig == signal.SIGINT else sig.name  # Ctrl-C's line says so
    assert len(lines) == 1 and lines[0].startswith("mask-replay: error: ") and said in lines[0], err
    assert (tmp_path / "s.json").read_text() == old  # nothing existing overwritten
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "r.safetensors", "s.json", "t.safetensors"]


@pytest.mark.slow
def test_score_killed_then_resumed_gives_the_uninterrupted_report(tmp_path):
    """SIGKILL (no handler runs) mid-score, then `score --resume`: the report equals an uninterrupted
    run's, byte for byte, and the kill left nothing behind (the report is written whole, at the end)."""
    env = _score_inputs(tmp_path)
    proc = _score(tmp_path, env, "s.json")
    _mid_run(proc)
    proc.kill()  # SIGKILL ends a stopped process too
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "r.safetensors", "t.safetensors"]
    resumed = _score(tmp_path, env, "s.json", "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "skipped" not in err, err
    whole = _score(tmp_path, env, "whole.json")
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err
    assert (tmp_path / "s.json").read_bytes() == (tmp_path / "whole.json").read_bytes()
    again = _score(tmp_path, env, "s.json", "--resume")  # now complete: kept as it is
    _, err = again.communicate(timeout=60)
    assert again.returncode == 0 and "skipped" in err, err
