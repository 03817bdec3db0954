"""Vocab-parallel replay under torchrun over gloo: 2 ranks (even and uneven shards) and 3 ranks
(uneven), against the single-process op. The checks themselves run in dist_replay_worker.py."""
import os
import re

import pytest
import torch

from tests.helpers import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "vocab_parallel_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_vocab_parallel_matches_single_process(nproc):
    proc = torchrun(nproc, WORKER, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(nproc):
        assert f"rank {rank}: 26 cases ok" in proc.stdout, proc.stdout[-3000:]


def _bad_arguments():
    from mask_replay import SamplingMask
    from mask_replay.trainer.vocab_parallel import replay_logprobs_vocab_parallel as tp
    from mask_replay.trainer.vocab_parallel import replay_logprobs_vocab_parallel_from_hidden as tph

    mask, y, z = SamplingMask.from_lists([[0, 1], [2]]), torch.tensor([0, 2]), torch.zeros(2, 4)
    h, w = torch.zeros(2, 3), torch.zeros(4, 3)
    return [
        (lambda: tp(z[0], mask, y, vocab_start=0), "logits_shard must be a 2-D tensor, got 1-D"),
        (lambda: tp(z.long(), mask, y, vocab_start=0), "logits_shard must be float32"),
        (lambda: tp(z, mask, y, vocab_start=-1), "vocab_start must be a non-negative int, got -1"),
        (lambda: tp(z, mask, y, vocab_start=True), "vocab_start must be a non-negative int, got True"),
        (lambda: tp(z[:1], mask, y, vocab_start=0), "mask has 2 rows but the shard has 1"),
        (lambda: tp(z, mask, y[:1], vocab_start=0), "sampled must be a tensor of shape [2]"),
        (lambda: tp(z, SamplingMask(torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([0, 2, 3])), y,
                    vocab_start=0),
         "token_ids of row 0 are not strictly ascending"),
        (lambda: tph(h, w[:, :2], mask, y, vocab_start=0), "weight_shard: expected [V_p, 3]"),
        (lambda: tph(h, w, mask, y, vocab_start=0, bias_shard=torch.zeros(3)), "bias_shard: expected [4]"),
        (lambda: tph(h, w.to("meta"), mask, y, vocab_start=0), "weight_shard is on meta but hidden is on cpu"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_arguments_are_named_before_any_collective(case):
    """Checked on each rank before communicating (no process group is needed to see them)."""
    call, message = _bad_arguments()[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
