"""ReplayGRPOTrainer on 2 CPU ranks under torchrun (gloo). DDP: per-rank supports against a float64
reference, replay metrics averaged over all ranks' tokens, DDP replicas equal after training with
num_iterations 2 and steps_per_generation 2 (trl_distributed_worker.py). FSDP2: the loss-side head
against the same model unsharded (trl_fsdp_worker.py)."""
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


FSDP_WORKER = os.path.join(os.path.dirname(__file__), "trl_fsdp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["root", "head"])
def test_replay_head_under_fsdp2(layout, tmp_path):
    """The head in FSDP2's root (a plain Parameter when replay reads it) or sharded on its own (a
    DTensor: gathered with its gradient averaged back, as FSDP2 averages every other gradient)."""
    proc = torchrun(2, FSDP_WORKER, layout, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        assert f"rank {rank}: ok ({layout})" in proc.stdout, proc.stdout[-3000:]
