"""Vocab-parallel replay under torchrun over gloo: 2 ranks (even and uneven shards) and 3 ranks
(uneven), against the single-process op. The checks themselves run in dist_replay_worker.py."""
import os

import pytest

from dist_launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "dist_replay_worker.py")


@pytest.mark.parametrize("nproc", [2, 3])
def test_vocab_parallel_matches_single_process(nproc):
    proc = torchrun(nproc, WORKER, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(nproc):
        assert f"rank {rank}: 26 cases ok" in proc.stdout, proc.stdout[-3000:]
