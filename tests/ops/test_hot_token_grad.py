"""The sparse LM head's weight gradient when one token is in every row's support (one long run of
entries): the CPU cuts the run's columns over threads, CUDA cuts the run into chunks whose partial
sums are added in a fixed order. Both against the dense fp64 reference, and deterministic."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay as mr
from tests.helpers import DEVICES, grads, hidden_ref


def hot_case(n, v, d, k, seed, device, dtype=torch.float64, hot_tokens=(0,)):
    """n rows of k tokens each; every token of hot_tokens in every row; sampled inside."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        drawn = (torch.randperm(v - len(hot_tokens), generator=g)[: k - len(hot_tokens)] + len(hot_tokens)).tolist()
        rows.append(sorted(list(hot_tokens) + drawn))
    sampled = torch.tensor([row[int(torch.randint(k, (), generator=g))] for row in rows], device=device)
    mask = mr.SamplingMask.from_lists(rows).to(device)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(device, dtype)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5).to(device, dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(device, dtype)
    t = (0.5 + torch.rand(n, generator=g)).to(device)
    return h, w, b, mask, sampled, t


def head_grads(h, w, b, mask, sampled, t):
    return grads(lambda h, w, b: mr.replay_logprobs_from_hidden(h, w, mask, sampled, t, bias=b), h, w, b)


def reference_grads(h, w, b, mask, sampled, t):
    dense = mask.to_dense(w.shape[0])
    return grads(lambda h, w, b: hidden_ref(h, w, b, dense, sampled, t), h, w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [0, 5, 300, 1100])
def test_hot_token_gradient_matches_reference(device, d):
    # 700 rows: the hot run of 700 entries crosses several CUDA chunks (128 entries) and, at
    # d >= 300, is cut into column blocks on the CPU; two hot tokens make two neighbouring runs.
    h, w, b, mask, y, t = hot_case(700, 400, d, 5, seed=d, device=device, hot_tokens=(0, 1))
    got = head_grads(h, w, b, mask, y, t)
    want = reference_grads(h, w, b, mask, y, t)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("device", DEVICES)
def test_hot_token_gradient_float32(device):
    h, w, b, mask, y, t = hot_case(1000, 300, 640, 4, seed=3, device=device, dtype=torch.float32)
    got = head_grads(h, w, b, mask, y, t)
    want = reference_grads(h.double(), w.double(), b.double(), mask, y, t)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_hot_token_gradient_is_deterministic(device):
    h, w, b, mask, y, t = hot_case(1500, 300, 520, 6, seed=4, device=device, dtype=torch.float32)
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1, 2):  # the CPU's cut into column blocks follows the thread count
            torch.set_num_threads(threads)
            runs.append(head_grads(h, w, b, mask, y, t))
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(runs[0], run))


@given(n=st.integers(1, 400), v=st.integers(3, 60), d=st.integers(0, 40), k=st.integers(2, 3),
       hot=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_property_runs_of_any_length(n, v, d, k, hot, seed):
    h, w, b, mask, y, t = hot_case(n, v, d, k, seed, "cpu", hot_tokens=tuple(range(min(hot, k - 1))))
    for g, r in zip(head_grads(h, w, b, mask, y, t), reference_grads(h, w, b, mask, y, t)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
