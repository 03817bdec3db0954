"""Memory safety at the op boundary: every op validates every index it dereferences (issue 9 §1).

Calls that crashed or silently misbehaved before run in a subprocess, so a regression fails its
test instead of killing pytest. Each must end in a clean Python exception naming the argument and
the row.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mask_replay
from mask_replay import MaskFormatError, SamplingMask

HERE = os.path.dirname(os.path.abspath(__file__))
ops = torch.ops.mask_replay

# Each case is a snippet run in one subprocess (torch, mask_replay, ops `o` and the helpers
# below in scope); it must raise. Expected: fragments of the error message.
PRELUDE = """
import torch, mask_replay
o = torch.ops.mask_replay
torch.manual_seed(0)
z = torch.randn(3, 100)
t = torch.ones(3)
g = torch.ones(3)
def fwd(ids, off, y, fallback=True):
    return o.replay_fwd(z, torch.tensor(ids, dtype=torch.int32), torch.tensor(off), torch.tensor(y), t, fallback)
def head(n=3, d=4, v=100):
    return torch.randn(n, d), torch.randn(v, d), torch.empty(0)
"""

CASES = {
    # the SIGSEGV: a fallback row's sampled token changed between forward and backward
    "replay_bwd_fallback_sampled_1e9": ("""
zz = z.clone().requires_grad_(True); y = torch.tensor([1, 2, 3])
m = mask_replay.SamplingMask.from_lists([[1], [2], [4]])
lp = mask_replay.replay_logprobs(zz, m, y, fallback=True)
y.numpy()[2] = 10**9
lp.sum().backward()
""", ["replay_bwd", "sampled token 1000000000 of row 2", "out of range [0, 100)"]),
    # sampled = V was a silent heap overflow (one past the row)
    "replay_bwd_fallback_sampled_V": ("""
ids, off = torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3])
lp, lse, status = fwd([1, 2, 4], [0, 1, 2, 3], [1, 2, 3])
o.replay_bwd(g, z, ids, off, torch.tensor([1, 2, 100]), t, lse, status)
""", ["replay_bwd", "sampled token 100 of row 2", "out of range"]),
    "full_bwd_sampled_out_of_range": ("""
lp, lse = o.full_fwd(z, torch.tensor([1, 2, 3]), t)
o.full_bwd(g, z, torch.tensor([1, 2, 100]), t, lse)
""", ["full_logprobs_bwd", "sampled token 100 of row 2"]),
    "full_bwd_negative_sampled": ("""
lp, lse = o.full_fwd(z, torch.tensor([1, 2, 3]), t)
o.full_bwd(g, z, torch.tensor([-1, 2, 3]), t, lse)
""", ["full_logprobs_bwd", "sampled token -1 of row 0"]),
    "full_bwd_zero_temperature": ("""
lp, lse = o.full_fwd(z, torch.tensor([1, 2, 3]), t)
o.full_bwd(g, z, torch.tensor([1, 2, 3]), torch.tensor([1.0, 0.0, 1.0]), lse)
""", ["full_logprobs_bwd", "temperature must be finite and > 0, row 1 has 0"]),
    "replay_fwd_offsets_start_at_1": ("fwd([1, 2, 3], [1, 2, 3, 3], [1, 2, 3])",
                                      ["replay", "offsets are invalid at row 0", "offsets[0] = 1"]),
    "replay_fwd_trailing_ids": ("fwd([1, 2, 4, 5], [0, 1, 2, 3], [1, 2, 4])",
                                ["offsets are invalid at row 2", "token_ids has 4 entries"]),
    "replay_fwd_decreasing_offsets": ("fwd([1, 2, 4], [0, 2, 1, 3], [1, 2, 4])",
                                      ["offsets are invalid at row 1"]),
    "replay_fwd_offsets_past_end": ("fwd([1, 2, 4], [0, 1, 2**40, 3], [1, 2, 4])",
                                    ["offsets are invalid at row 1"]),
    "replay_fwd_empty_batch_offsets": ("""
o.replay_fwd(z[:0], torch.tensor([], dtype=torch.int32), torch.tensor([3]), torch.tensor([], dtype=torch.long),
             t[:0], False)
""", ["replay", "empty batch needs offsets = [0]"]),
    "kept_mass_offsets_start_at_1": ("""
o.kept_mass(z, torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3, 3]), t)
""", ["kept_mass", "offsets are invalid at row 0"]),
    "replay_bwd_forged_ids": ("""
lp, lse, status = fwd([1, 2, 4], [0, 1, 2, 3], [1, 2, 4])
o.replay_bwd(g, z, torch.tensor([1, 2, 200], dtype=torch.int32), torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 4]),
             t, lse, status)
""", ["replay_bwd", "token_ids of row 2 hold an id outside [0, 100)"]),
    "replay_bwd_forged_offsets": ("""
lp, lse, status = fwd([1, 2, 4], [0, 1, 2, 3], [1, 2, 4])
o.replay_bwd(g, z, torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 2**40]),
             torch.tensor([1, 2, 4]), t, lse, status)
""", ["replay_bwd", "offsets are invalid at row 2"]),
    "hidden_fwd_offsets_start_at_1": ("""
h, w, b = head()
o.hidden_fwd(h, w, b, torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 2, 3, 3]), torch.tensor([1, 2, 3]),
             t, True)
""", ["replay_from_hidden", "offsets are invalid at row 0"]),
    "hidden_bwd_fallback_sampled_1e9": ("""
h, w, b = head()
ids, off = torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3])
lp, lse, status = o.hidden_fwd(h, w, b, ids, off, torch.tensor([1, 2, 3]), t, True)
o.hidden_bwd(g, h, w, b, ids, off, torch.tensor([1, 2, 10**9]), t, lse, status)
""", ["replay_from_hidden_bwd", "sampled token 1000000000 of row 2"]),
    "hidden_bwd_forged_ids": ("""
h, w, b = head()
ids, off = torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3])
lp, lse, status = o.hidden_fwd(h, w, b, ids, off, torch.tensor([1, 2, 4]), t, True)
o.hidden_bwd(g, h, w, b, torch.tensor([1, -7, 4], dtype=torch.int32), off, torch.tensor([1, 2, 4]), t, lse, status)
""", ["replay_from_hidden_bwd", "token_ids of row 1 hold an id outside [0, 100)"]),
    "hidden_bwd_trailing_ids": ("""
h, w, b = head()
ids, off = torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 1, 2, 3])
lp, lse, status = o.hidden_fwd(h, w, b, ids, off, torch.tensor([1, 2, 4]), t, True)
o.hidden_bwd(g, h, w, b, torch.tensor([1, 2, 4, 99999], dtype=torch.int32), off, torch.tensor([1, 2, 4]), t, lse,
             status)
""", ["replay_from_hidden_bwd", "offsets are invalid at row 2"]),
}

DRIVER = PRELUDE + """
import json, sys
cases = json.loads(sys.argv[1])
out = {}
for name, code in cases.items():
    print("START", name, flush=True)  # names the culprit if the process dies
    try:
        exec(code, dict(globals()))
        out[name] = None
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print("RESULT", json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def hostile_results():
    cases = {name: code for name, (code, _) in CASES.items()}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    started = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("START")]
    assert r.returncode == 0, (f"the process died (status {r.returncode}) in case {started[-1] if started else '?'}:"
                               f"\n{r.stderr[-3000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_call_raises_a_clean_error(hostile_results, name):
    message = hostile_results[name]
    assert message is not None, f"{name}: the call returned instead of raising"
    assert message.startswith(("RuntimeError", "ValueError")), message
    for fragment in CASES[name][1]:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    assert "\n" not in message.split(" (")[0]


@pytest.mark.slow
def test_fuzz_loop_survives_hostile_inputs():
    """A few seconds of the ASAN fuzz loop with the normal build: a crash fails the test."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_ops.py"), "--seconds", "4", "--seed", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"status {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "no crash" in r.stdout and " 0 calls" not in r.stdout


# ---- one CSR contract: the ops accept exactly the masks SamplingMask.validate() accepts --------
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 4),
    ids=st.lists(st.integers(-2, 9), max_size=8),
    cuts=st.lists(st.integers(-2, 10), min_size=0, max_size=5),
)
def test_ops_and_validate_share_one_csr_contract(n, ids, cuts):
    v = 8
    offsets = torch.tensor((cuts + [0] * (n + 1))[: n + 1], dtype=torch.int64)
    mask = SamplingMask(torch.tensor(ids, dtype=torch.int32), offsets)
    try:
        mask.validate(vocab_size=v)
        valid = True
    except MaskFormatError:
        valid = False
    z = torch.randn(n, v)
    t = torch.ones(n)
    try:
        ops.kept_mass(z, mask.token_ids, mask.offsets, t)
        accepted = True
    except RuntimeError:
        accepted = False
    assert accepted == valid, (ids, offsets.tolist())
    y = torch.zeros(n, dtype=torch.int64)
    try:
        ops.replay_fwd(z, mask.token_ids, mask.offsets, y, t, True)  # fallback: only CSR defects raise
        accepted = True
    except RuntimeError:
        accepted = False
    assert accepted == valid, (ids, offsets.tolist())


def test_valid_masks_still_replay_and_differentiate():
    """The checks refuse only what is broken: a valid batch replays, with gradients, as before."""
    z = torch.randn(4, 50, dtype=torch.float64, requires_grad=True)
    m = SamplingMask.from_lists([[1, 5], [], [7], [0, 49]])
    y = torch.tensor([5, 3, 8, 49])
    lp = mask_replay.replay_logprobs(z, m, y, fallback=True)
    lp.sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(z.grad).all()
    full = torch.log_softmax(z.detach(), 1)
    assert torch.allclose(lp[1], full[1, 3]) and torch.allclose(lp[2], full[2, 8])
