"""A command joins a process group only when torchrun launched it: one started from inside a torchrun
job (a training script's subprocess, which inherits RANK and WORLD_SIZE) runs as one process instead
of waiting for ranks that never come. A rank that waits says on stderr what for after a few seconds."""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from mask_replay import SamplingMask
from mask_replay.tools import launch
from tests.helpers import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), MASK_REPLAY_DIST_TIMEOUT="20")
    env.pop(launch.FORCE_ENV, None)
    env.update(extra)
    return env


def _rollout(tmp_path):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(12, 16, generator=g)
    save_file({"logits": z, "sampled": z.argmax(1)}, str(tmp_path / "r.safetensors"))
    return str(tmp_path / "r.safetensors")


def test_torchrun_parents_are_recognised():
    assert launch._is_torchrun(["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node=2", "-m", "x"])
    assert launch._is_torchrun(["python", "-m", "torch.distributed.run", "--standalone", "x.py"])
    assert not launch._is_torchrun(["python", "train.py", "--config", "torchrun.yaml"])
    assert not launch._is_torchrun(["bash", "-c", "mask-replay capture"])


def test_not_under_torchrun_from_a_plain_parent(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(launch.FORCE_ENV, raising=False)
    assert not launch.under_torchrun()  # pytest is this process's parent, not torchrun
    monkeypatch.setenv(launch.FORCE_ENV, "1")
    assert launch.under_torchrun()


def test_waiting_note_says_what_a_rank_waits_for(capfd):
    with launch.waiting_note("2 ranks to join the process group at h:1", after=0.05):
        time.sleep(0.3)
    err = capfd.readouterr().err
    assert "still waiting for 2 ranks to join the process group at h:1" in err
    with launch.waiting_note("nothing", after=5):
        pass
    assert "nothing" not in capfd.readouterr().err


@pytest.mark.slow
def test_command_started_inside_a_torchrun_job_runs_as_one_process(tmp_path):
    path = _rollout(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "mask_replay", "capture", path, "-o", str(tmp_path / "m.safetensors")],
                          env=_job_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert run("capture", path, "-o", tmp_path / "one.safetensors").exit_code == 0
    assert SamplingMask.load(str(tmp_path / "m.safetensors")) == SamplingMask.load(str(tmp_path / "one.safetensors"))


@pytest.mark.slow
def test_a_rank_waiting_for_others_says_so(tmp_path):
    path = _rollout(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "mask_replay", "capture", path, "-o", str(tmp_path / "m.safetensors")],
                          env=_job_env(**{launch.FORCE_ENV: "1", "MASK_REPLAY_DIST_TIMEOUT": "8"}),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "rank 0: still waiting for 2 ranks to join the process group at 127.0.0.1" in proc.stderr
    assert not (tmp_path / "m.safetensors").exists()
