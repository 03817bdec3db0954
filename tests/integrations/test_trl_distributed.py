"""ReplayGRPOTrainer on 2 CPU ranks under torchrun (gloo): per-rank supports against a float64
reference, replay metrics averaged over all ranks' tokens, DDP replicas equal after training with
num_iterations 2 and steps_per_generation 2. The checks run in trl_distributed_worker.py."""
import os

import pytest

from tests.helpers import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "trl_distributed_worker.py")


@pytest.mark.slow
def test_replay_trainer_on_two_ranks(tmp_path):
    proc = torchrun(2, WORKER, str(tmp_path), timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        assert f"rank {rank}: ok" in proc.stdout, proc.stdout[-3000:]
