"""Every device reports a bad support row the way the CPU's sequential check does: the error of the
row's first failing entry. CUDA checks a row's entries on 32 lanes at once; its reduction is
emulated on the host (tests/cpp/entry_check_emulation.cpp) and run on the device where there is one."""
import subprocess

import pytest
import torch

import mask_replay as mr
from mask_replay._ops import ops
from tests.helpers import DEVICES

VOCAB = 151936
# Row 1: entry 1 is outside [0, V), entry 2 is not above entry 1. The first failure is the range
# error; the smallest error code (what CUDA used to report) is "not strictly ascending".
ROWS = [[1, 2], [3, 200000, 5]]
MESSAGE = rf"token_ids of row 1 hold an id outside \[0, {VOCAB}\)"


def test_parallel_entry_check_matches_sequential(cpp_program):
    out = subprocess.run([cpp_program("entry_check_emulation")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("0/")


def bad_mask(device):
    ids = torch.tensor([i for row in ROWS for i in row], dtype=torch.int32, device=device)
    offsets = torch.tensor([0, len(ROWS[0]), len(ROWS[0]) + len(ROWS[1])], dtype=torch.int64, device=device)
    return mr.SamplingMask(ids, offsets)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_ops_name_the_first_failing_entry(device):
    mask = bad_mask(device)
    logits = torch.randn(2, VOCAB, device=device)
    sampled = torch.tensor([1, 3], device=device)
    t = torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match=MESSAGE):
        mr.replay_logprobs(logits, mask, sampled)
    with pytest.raises(RuntimeError, match=MESSAGE):
        mr.replay_logprobs(logits, mask, sampled, fallback=True)
    with pytest.raises(RuntimeError, match=MESSAGE):
        mr.kept_mass(logits, mask)
    with pytest.raises(RuntimeError, match=MESSAGE):  # the backward checks its inputs again
        ops.replay_bwd(torch.ones(2, device=device), logits, mask.token_ids, mask.offsets, sampled, t,
                       torch.zeros(2, device=device), torch.zeros(2, dtype=torch.int8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_hidden_ops_name_the_first_failing_entry(device):
    mask = bad_mask(device)
    hidden = torch.randn(2, 8, device=device)
    weight = torch.randn(VOCAB, 8, device=device)
    sampled = torch.tensor([1, 3], device=device)
    t = torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match=MESSAGE):
        mr.replay_logprobs_from_hidden(hidden, weight, mask, sampled)
    with pytest.raises(RuntimeError, match=MESSAGE):
        ops.hidden_bwd(torch.ones(2, device=device), hidden, weight, torch.empty(0, device=device), mask.token_ids,
                       mask.offsets, sampled, t, torch.zeros(2, device=device),
                       torch.zeros(2, dtype=torch.int8, device=device))
