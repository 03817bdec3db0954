"""Shared test helpers: the independent pure-PyTorch references every kernel is tested against,
the devices the suite runs on, and the small dumps and CLI runner of the command-line tests.

Capture reference (sort-based, fp64 masses). It does not share code with the kernels: sorting instead
of radix selection, torch.exp in fp64 instead of the kernels' fixed-point masses. Because the two mass
computations differ by rounding, the reference returns two supports per row: `strict` (top-p boundary
moved in by `margin` of the total mass) and `loose` (moved out). A correct kernel satisfies
strict <= kernel <= loose, and where the boundary is not within `margin` of a cumulative mass the two
coincide (exact check).

Replay references: dense float64 log-softmax over the support (a boolean [N, V] mask), gradients by
autograd through them.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from hypothesis import strategies as st
from safetensors.torch import save_file

from mask_replay.cli.main import main

# Every device the suite sees: the CUDA cases are collected everywhere and skipped without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


# ---- capture reference -----------------------------------------------------------------------------
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def fixture(name):
    """A recorded or hand-written engine response in tests/fixtures/, parsed."""
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def _expand(v, n, off):
    if v is None:
        return [off] * n
    if isinstance(v, torch.Tensor):
        return v.expand(n).tolist() if v.dim() == 0 else v.tolist()
    return [v] * n


def reference_row(z: torch.Tensor, t: float, k, p, mp, margin: float):
    v = z.numel()
    z = z.float()
    if t == 0.0:
        one = torch.zeros(v, dtype=torch.bool)
        one[int(torch.argmax(z))] = True  # torch.argmax returns the first maximal index
        return one, one.clone()
    x = z / torch.full_like(z, t)
    finite = torch.isfinite(x)
    m = x[finite].max()
    if mp is not None and mp > 0:
        thr = m + torch.tensor(math.log(mp), dtype=torch.float32)
    else:
        thr = torch.tensor(-3.4028234663852886e38, dtype=torch.float32)
    s = finite & (x >= thr)
    if k is not None and 0 < k < int(s.sum()):
        vk = torch.sort(x[s], descending=True).values[k - 1]
        s = s & (x >= vk)
    if p is None or p >= 1.0:
        return s, s.clone()
    idx = torch.nonzero(s).flatten()
    vals = x[idx]
    probs = torch.exp(vals.double() - float(m))
    probs = probs / probs.sum()
    order = torch.argsort(vals)
    asc, pasc = vals[order], probs[order]
    upto = torch.cumsum(pasc, 0)  # mass of elements <= value
    last = torch.searchsorted(asc, vals, right=True) - 1
    above = (1.0 - upto[last]).clamp_min(0.0)  # mass strictly greater than each element
    strict = torch.zeros(v, dtype=torch.bool)
    loose = torch.zeros(v, dtype=torch.bool)
    strict[idx] = above < p - margin
    loose[idx] = above < p + margin
    strict[idx[vals == vals.max()]] = True  # the top group is always kept (its mass above is 0)
    return strict, loose


def reference_support(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, margin=1e-5):
    """(strict, loose) bool [N, V] supports for logits [N, V] (any float dtype) and parameters
    given as scalars, per-row tensors or None."""
    n, v = logits.shape
    ts, ks, ps, mps = (_expand(a, n, off) for a, off in
                       ((temperature, 1.0), (top_k, None), (top_p, None), (min_p, None)))
    strict = torch.zeros(n, v, dtype=torch.bool)
    loose = torch.zeros(n, v, dtype=torch.bool)
    for r in range(n):
        k = None if ks[r] is None else int(ks[r])
        strict[r], loose[r] = reference_row(logits[r].cpu(), float(ts[r]), k, ps[r], mps[r], margin)
    return strict, loose


def reference_logprob_and_mass(logits, support: torch.Tensor, sampled, temperature=1.0):
    """fp64 log-prob of sampled over the dense support and kept mass of the support."""
    n, v = logits.shape
    ts = _expand(temperature, n, 1.0)
    lp = torch.empty(n, dtype=torch.float64)
    km = torch.empty(n, dtype=torch.float64)
    for r in range(n):
        t = float(ts[r])
        x = logits[r].double() / (t if t > 0 else 1.0)
        full = torch.logsumexp(x, 0)
        sub = torch.logsumexp(x.masked_fill(~support[r], float("-inf")), 0)
        lp[r] = 0.0 if t == 0 else x[int(sampled[r])] - sub
        km[r] = 1.0 if t == 0 else torch.exp(sub - full)
    return lp, km


# ---- replay references -----------------------------------------------------------------------------
def _x(logits, temperature, dtype):
    # Temperature is a float32 parameter (as in sampling engines): round it there first.
    n = logits.shape[0]
    t = torch.as_tensor(temperature).to(torch.float32).reshape(-1).expand(n) if n else torch.ones(0)
    return logits.to(dtype) / t.to(device=logits.device, dtype=dtype)[:, None]


def replay_ref(logits, dense_mask, sampled, temperature=1.0, *, fallback=False, dtype=torch.float64):
    """Log-prob of sampled over the support; rows whose sampled token is outside the support (or
    whose support is empty) use the full vocabulary when fallback, else give nan."""
    x = _x(logits, temperature, dtype)
    y = sampled.long()[:, None]
    inside = dense_mask.gather(1, y)[:, 0] & dense_mask.any(1)
    lp = torch.log_softmax(x.masked_fill(~dense_mask, float("-inf")), dim=1).gather(1, y)[:, 0]
    if fallback:
        full = torch.log_softmax(x, dim=1).gather(1, y)[:, 0]
        lp = torch.where(inside, lp, full)
    return lp


def full_ref(logits, sampled, temperature=1.0, *, dtype=torch.float64):
    return torch.log_softmax(_x(logits, temperature, dtype), dim=1).gather(1, sampled.long()[:, None])[:, 0]


def kept_mass_ref(logits, dense_mask, temperature=1.0, *, dtype=torch.float64):
    x = _x(logits, temperature, dtype)
    return torch.exp(torch.logsumexp(x.masked_fill(~dense_mask, float("-inf")), 1) - torch.logsumexp(x, 1))


def hidden_ref(hidden, weight, bias, dense_mask, sampled, temperature=1.0, *, fallback=False, dtype=torch.float64):
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return replay_ref(logits, dense_mask, sampled, temperature, fallback=fallback, dtype=dtype)


def grads(fn, *tensors):
    """Gradients of fn(*tensors).sum() w.r.t. each tensor (leaf copies, so inputs are untouched)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device) if out.numel() else out
    return torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)


# ---- command-line helpers: small rollout dumps, the click runner, one-line error checks -------------
N, V = 24, 40
TOP_P = 0.8


def make_logits(n=N, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(n, v, generator=g)
    return z


def rollout_tensors(n=N, v=V, seed=0, **extra):
    z = make_logits(n, v, seed)
    t = {
        "logits": z,
        "sampled": torch.argmax(z, dim=1),  # the top token is in every support
        "top_p": torch.tensor(TOP_P),
        "step": torch.arange(n) // 8,
        "sequence": (torch.arange(n) % 8) // 4,
    }
    t.update(extra)
    return t


def write(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def write_dump(path, tensors):
    """A dump in the format its suffix names: .safetensors, .pt (torch.save) or .npz (numpy)."""
    path = str(path)
    if path.endswith(".pt"):
        torch.save(tensors, path)
    elif path.endswith(".npz"):
        np.savez(path, **{k: v.numpy() for k, v in tensors.items()})
    else:
        write(path, tensors)
    return pathlib.Path(path)


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mask-replay: error: "), lines[0]
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])


def assert_clean(folder, *absent):
    for name in absent:
        assert not os.path.exists(os.path.join(folder, name)), name
    leftovers = [f for f in os.listdir(folder) if f.endswith(".tmp")]
    assert leftovers == [], leftovers



# ---- the CPU's vector extensions ---------------------------------------------------------------------
def cpu_flags() -> set:
    """The flags of /proc/cpuinfo (empty where it cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The subsets capture's AVX-512 loops need (csrc/cpu/capture_cpu_avx512.h: cpu_supports_avx512).
HAS_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_flags()


# ---- help, version, info ------------------------------------------------------------------------


# ---- children that must see Ctrl-C -------------------------------------------------------------
def restore_ctrl_c() -> None:
    """preexec_fn for a child the test sends SIGINT: a job started in the background by a
    non-interactive shell (CI runners, `make test &`) inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler; restore the default, as an interactive terminal has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---- torchrun from the tests -------------------------------------------------------------------------
def torchrun(nproc: int, *args, timeout: float = 60, env=None, cwd=None) -> subprocess.CompletedProcess:
    """torchrun --standalone (a free rendezvous port, so tests can run side by side), one thread per
    rank (the CI machine has few cores). The timeout bounds a hung collective, too."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


def end_distributed_worker() -> None:
    """A torchrun worker's last call, once every check in it has passed: barrier, destroy the process
    groups, flush, and leave with os._exit(0) instead of interpreter finalisation. Gloo's worker
    threads can still hold work objects whose tensors reference Python objects; destroying them while
    the interpreter is torn down aborts the process ("terminate called without an active exception"),
    the mechanism described in pytorch/pytorch PR 179291. CI saw it once after both ranks had printed
    ok, with destroy_process_group already called: the abort is in teardown, not in the code tested."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- score reports: the streamed report against build_report's in-memory one -----------------------
# the report's numbers that streaming leaves the same floats (the others are sums: equal to rounding)
REPORT_EXACT_KEYS = ("tokens", "sequences", "frac_outside_0.9_1.1", "importance_ratio_median", "support_kl_max",
                     "ratio_tokens_different", "sequence_ratio_mean", "sequence_ratio_median", "sequence_ratio_std",
                     "sequence_log_ratio_mean", "sequence_log_ratio_std")


def _series_scales(rollout, x):
    with np.errstate(all="ignore"):
        d = x - rollout
        r = np.exp(d)
        return {"importance_ratio_mean": np.mean(r), "logp_diff_mean": np.mean(np.abs(d)),
                "kl_k1": np.mean(np.abs(d)), "kl_k3": np.mean(np.abs(r - 1 - d)), "chi2": np.mean(r * r),
                "logp_diff_std": np.max(np.abs(d))}


def report_scales(rollout, replay, no_replay, kept, step=None, *_):
    """The size of what each mean sums, shaped as the report: two correct float64 sums of those terms
    differ by a few ulp of it (chi2 = E[r^2] - 1 and E[d] cancel, so relative to the value itself
    they need not)."""
    if not rollout.size:
        return {}
    out = {"replay": _series_scales(rollout, replay), "no_replay": _series_scales(rollout, no_replay)}
    if step is not None:
        out["per_step"] = {str(s): report_scales(rollout[step == s], replay[step == s], no_replay[step == s],
                                                 kept[step == s]) for s in np.unique(step)}
    return out


def assert_same_report(got, want, scales=None, path="report"):
    """Score reports equal: counts, maxima, medians and the sequence metrics exactly; a mean to 1e-12
    of the size of what it sums (scales: report_scales of the tokens, else the value itself)."""
    assert type(got) is type(want) or {type(got), type(want)} <= {int, float}, (path, got, want)
    if isinstance(want, dict):
        assert list(got) == list(want), (path, list(got), list(want))
        for k in want:
            assert_same_report(got[k], want[k], (scales or {}).get(k), f"{path}.{k}")
        return
    key = path.rsplit(".", 1)[-1]
    if isinstance(want, int) or key in REPORT_EXACT_KEYS or not math.isfinite(want):
        assert got == want or (math.isnan(got) and math.isnan(want)), (path, got, want)
        return
    scale = abs(want) if scales is None else scales
    assert abs(got - want) <= 1e-12 * max(abs(want), scale) + 1e-300, (path, got, want, scale)



# ---- supports as they arrive from outside (engines, rollout servers, JSON), some damaged ----------
SUPPORT_DAMAGE = ("none", "wrapping_id", "negative_id", "unrebased_offsets", "decreasing_offsets", "descending_ids")


@st.composite
def arriving_support(draw, vocab: int, max_rows: int = 6):
    """(rows, token_ids, offsets, damage): rows a valid support (ids ascending in [0, vocab), some rows
    empty); token_ids / offsets the same as Python lists or numpy int64 / uint64 arrays, with one drawn
    damage applied ('none': still valid). 'wrapping_id' adds k * 2^32 to an id, the same id once cast
    to int32; 'unrebased_offsets' is a slice of a longer CSR whose offsets were not shifted back to 0."""
    rows = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=5, unique=True).map(sorted),
                         min_size=1, max_size=max_rows))
    damage = draw(st.sampled_from(SUPPORT_DAMAGE))
    if damage in ("wrapping_id", "negative_id", "descending_ids") and not any(rows):
        rows[0] = [1]
    ids = [i for r in rows for i in r]
    offsets = np.cumsum([0] + [len(r) for r in rows]).tolist()
    e = draw(st.integers(0, max(len(ids) - 1, 0)))
    if damage == "wrapping_id":
        ids[e] += 2 ** 32 * draw(st.integers(1, 2 ** 30))
    elif damage == "negative_id":
        ids[e] = -draw(st.integers(1, 2 ** 40))
    elif damage == "descending_ids":  # the entry repeated in its row: not strictly ascending
        r = next(r for r in range(len(rows)) if offsets[r] <= e < offsets[r + 1])
        ids.insert(e, ids[e])
        offsets = offsets[:r + 1] + [o + 1 for o in offsets[r + 1:]]
    elif damage == "unrebased_offsets":
        shift = draw(st.integers(1, 3))
        ids = [draw(st.integers(0, vocab - 1)) for _ in range(shift)] + ids
        offsets = [o + shift for o in offsets]
    elif damage == "decreasing_offsets":  # an inner offset above the next one, the last still nnz
        if len(offsets) == 2:
            offsets = [0, len(ids) + 1, len(ids)]
        else:
            r = draw(st.integers(1, len(offsets) - 2))
            offsets[r] = offsets[r + 1] + draw(st.integers(1, 3))
    kind = draw(st.sampled_from(("list", "int64", "uint64") if min(ids, default=0) >= 0 else ("list", "int64")))
    if kind == "list":
        return rows, ids, offsets, damage
    dtype = np.int64 if kind == "int64" else np.uint64
    return rows, np.asarray(ids, dtype=dtype), np.asarray(offsets, dtype=dtype), damage
