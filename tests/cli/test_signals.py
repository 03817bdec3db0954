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
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"mask-replay: error: terminated by {sig.name} (unfinished outputs removed)"], err
    assert sorted(os.listdir(tmp_path)) == ["r.safetensors"]
