"""One check per op for the self-test: run the kernel under test, compare with the expectation.

Two expectations (`Target.against_cpu`):
- on a GPU, the CPU kernels on the same inputs: supports, fixed-width layouts and row statuses
  bit-identical; log-normalisers, log-probs and kept masses within DEVICE_ULPS float32 ulps of
  max(1, |cpu|) (the two devices take `log` from different libraries and merge their online
  logsumexp partial sums in different orders, each merge rescaled by one float32 exp);
- on the CPU, the float64 references of mask_replay/tools/reference.py: supports between the
  reference's strict and loose answers (exact wherever no cumulative mass lies within 1e-5 of p),
  the float outputs within REFERENCE_ULPS (the kernels' exp is ~1 ulp; the reference is exact).
Gradients, both ways: |got - want| <= (4 eps(dtype) + 16 eps32) |want| + 16 eps32 max|want|. The
hidden-state ops add a float32 dot-product allowance 4 sqrt(d) eps32 |h| |w| / T to their log-probs, and
their gradients, sums over many rows or tokens in any order, are compared normwise:
|got - want| <= 4 eps(dtype) |want| + HEAD_GRAD_NORMWISE max|want| (5e-2 for the low-precision sparse
weight gradient, whose duplicate rows torch sums in the weight's own dtype).

Every check returns None when it passes, else one line saying what differs and where.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mask_replay.tools import reference as ref

EPS32 = torch.finfo(torch.float32).eps
DEVICE_ULPS = 8
REFERENCE_ULPS = 4  # measured: the CPU kernels stay within 0.5 ulp of the references on the full CPU matrix
# A hot token's weight gradient sums ~1000 rows: float32 rounding in any order is ~eps32 sqrt(n / 2) of the
# result on each side (~3e-6 at n = 1024); a lost or doubled row or chunk is >= 1e-3.
HEAD_GRAD_NORMWISE = 4e-5


@dataclass(frozen=True)
class Target:
    device: torch.device  # where the kernels under test run
    against_cpu: bool  # True: the CPU kernels are the expectation; False: the float64 references

    @property
    def expectation(self) -> str:
        return "CPU kernels" if self.against_cpu else "float64 references"


class Lazy:
    """A value computed on first use and kept (the inputs and references a group of cases share)."""

    def __init__(self, make: Callable):
        self._make, self._value, self._done = make, None, False

    def __call__(self):
        if not self._done:
            self._value, self._done = self._make(), True
        return self._value


def _fmt(x: float) -> str:
    return f"{x:.9g}"


def close_problem(name: str, got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> Optional[str]:
    """None when |got - want| <= tol everywhere (NaN matching NaN, equal infinities equal); else
    the worst entry."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.numel() == 0:
        return None
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs().nan_to_num(nan=math.inf))
    excess = diff - tol.expand_as(diff).cpu().double()
    if not bool((excess > 0).any()):
        return None
    worst = int(torch.argmax(excess))
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
    where = f"[{', '.join(map(str, at))}]"
    return (f"{name}{where}: {_fmt(float(got.reshape(-1)[worst]))}, expected {_fmt(float(want.reshape(-1)[worst]))} "
            f"(|diff| {float(diff.reshape(-1)[worst]):.3g} > tol {float(tol.expand_as(diff).reshape(-1)[worst]):.3g}; "
            f"{int((excess > 0).sum())} entries off)")


def ulp_problem(name: str, got, want, ulps: int, extra: float = 0.0) -> Optional[str]:
    """|got - want| <= ulps * eps32 * max(1, |want|) + extra."""
    w = want.detach().cpu().double()
    tol = ulps * EPS32 * w.abs().nan_to_num(posinf=1.0, neginf=1.0).clamp_min(1.0) + extra
    return close_problem(name, got, w, tol)


def grad_problem(name: str, got, want, dtype: torch.dtype, *, normwise: float = 0.0) -> Optional[str]:
    w = want.detach().cpu().double()
    scale = float(w.abs().max()) if w.numel() else 0.0
    eps = torch.finfo(dtype).eps
    if normwise:
        tol = 4 * eps * w.abs() + normwise * scale
    else:
        tol = (4 * eps + 16 * EPS32) * w.abs() + 16 * EPS32 * scale
    return close_problem(name, got, w, tol)


def first_problem(*problems: Optional[str]) -> Optional[str]:
    return next((p for p in problems if p), None)


def csr_problem(ids: torch.Tensor, offsets: torch.Tensor, vocab: int) -> Optional[str]:
    """The CSR contract: offsets from 0 to nnz, never decreasing; ids in [0, V), ascending per row."""
    if ids.dtype != torch.int32 or offsets.dtype != torch.int64:
        return f"CSR dtypes {ids.dtype}/{offsets.dtype}, expected int32/int64"
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets.diff() < 0).any()):
        return "offsets are not a CSR over the token ids"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return f"token id outside [0, {vocab})"
    step = ids.long().diff() <= 0
    starts = offsets[1:-1]
    step[(starts[(starts > 0) & (starts < ids.numel())] - 1)] = False  # a row may start below the last
    if bool(step.any()):
        e = int(torch.nonzero(step)[0]) + 1
        row = int(torch.searchsorted(offsets, torch.tensor(e), right=True)) - 1
        return f"row {row}: token ids not strictly ascending (entry {e})"
    return None


def _first_row(bad_rows: torch.Tensor) -> int:
    return int(torch.nonzero(bad_rows)[0])


def support_bounds_problem(dense: torch.Tensor, strict: torch.Tensor, loose: torch.Tensor) -> Optional[str]:
    missing, extra = strict & ~dense, dense & ~loose
    if bool(missing.any()):
        r = _first_row(missing.any(1))
        return (f"row {r}: {int(missing[r].sum())} token(s) the reference requires are missing "
                f"(first id {int(torch.nonzero(missing[r])[0])})")
    if bool(extra.any()):
        r = _first_row(extra.any(1))
        return (f"row {r}: {int(extra[r].sum())} token(s) the reference excludes are kept "
                f"(first id {int(torch.nonzero(extra[r])[0])})")
    return None


def csr_equal_problem(ids, offsets, ids_c, offsets_c, device) -> Optional[str]:
    if not torch.equal(offsets, offsets_c):
        lg, lc = offsets.diff(), offsets_c.diff()
        r = _first_row(lg != lc) if lg.shape == lc.shape and bool((lg != lc).any()) else 0
        return f"row {r}: {int(lg[r])} tokens on {device}, {int(lc[r])} on cpu"
    if not torch.equal(ids, ids_c):
        e = int(torch.nonzero(ids != ids_c)[0])
        r = int(torch.searchsorted(offsets, torch.tensor(e), right=True)) - 1
        return f"row {r}: token id {int(ids[e])} on {device}, {int(ids_c[e])} on cpu (entry {e})"
    return None


# ---- capture -----------------------------------------------------------------------------------
def check_capture(kernels, tg: Target, z: torch.Tensor, zd: torch.Tensor, params, params_d, bounds: Lazy):
    ids, offsets, logz = (t.cpu() for t in kernels.capture(zd, *params_d, True))
    sampled_rows = params[0] != 0  # greedy rows carry no log-normaliser
    problem = csr_problem(ids, offsets, z.shape[1])
    if problem:
        return problem
    if tg.against_cpu:
        ids_c, offsets_c, logz_c = kernels.capture(z, *params, True)
        again = [t.cpu() for t in kernels.capture(zd, *params_d, True)]
        rerun_same = all(torch.equal(a, b) for a, b in zip(again, (ids, offsets, logz)))
        return first_problem(
            csr_equal_problem(ids, offsets, ids_c, offsets_c, tg.device),
            ulp_problem("logz", logz[sampled_rows], logz_c[sampled_rows], DEVICE_ULPS),
            None if rerun_same else f"a second run on {tg.device} gave other bits (not deterministic)")
    strict, loose = bounds()
    want_logz = ref.log_normaliser(z, params[0])
    return first_problem(
        support_bounds_problem(ref.dense_from_csr(ids, offsets, z.shape[1]), strict, loose),
        ulp_problem("logz", logz[sampled_rows], want_logz[sampled_rows], REFERENCE_ULPS))


def check_capture_fixed(kernels, tg: Target, z, zd, params, params_d, bounds: Lazy, width: int):
    got = [t.cpu() for t in kernels.capture_fixed(zd, *params_d, width)]
    if tg.against_cpu:
        want = kernels.capture_fixed(z, *params, width)
    else:
        strict, loose = bounds()
        ids, offsets, _ = kernels.capture(z, *params, False)
        # Rows whose top-p boundary is ambiguous at the reference's margin take the CSR kernel's
        # own answer (checked against the bounds by the capture case).
        exact = (strict == loose).all(1, keepdim=True)
        want = ref.fixed_from_dense(torch.where(exact, strict, ref.dense_from_csr(ids, offsets, z.shape[1])), width)
    for name, a, b in zip(("ids", "counts", "overflow"), got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}"
        if not torch.equal(a, b):
            r = _first_row((a != b).reshape(a.shape[0], -1).any(1))
            return f"{name} differ from row {r}: {a[r].reshape(-1).tolist()[:8]} vs {b[r].reshape(-1).tolist()[:8]}"
    return None


# ---- replay over logits ------------------------------------------------------------------------
def check_replay_fwd(kernels, tg: Target, inp: dict, fallback: bool):
    d = inp["dev"]
    ids, offsets, y = ("ids_fb", "off_fb", "y_fb") if fallback else ("ids", "off", "y_in")
    logp, lse, status = (t.cpu() for t in kernels.replay_fwd(d["z"], d[ids], d[offsets], d[y], d["t"], fallback))
    if tg.against_cpu:
        want = kernels.replay_fwd(inp["z"], inp[ids], inp[offsets], inp[y], inp["t"], fallback)
        ulps = DEVICE_ULPS
    else:
        x = ref.scaled(inp["z"], inp["t"])
        want = ref.replay(x, ref.dense_from_csr(inp[ids], inp[offsets], x.shape[1]), inp[y])
        ulps = REFERENCE_ULPS
    if not torch.equal(status, want[2]):
        r = _first_row(status != want[2])
        return f"status of row {r}: {int(status[r])}, expected {int(want[2][r])}"
    return first_problem(ulp_problem("logp", logp, want[0], ulps), ulp_problem("lse", lse, want[1], ulps))


def check_replay_bwd(kernels, tg: Target, inp: dict):
    def grad_on(s):
        _, lse, status = kernels.replay_fwd(s["z"], s["ids_fb"], s["off_fb"], s["y_fb"], s["t"], True)
        return kernels.replay_bwd(s["grad"], s["z"], s["ids_fb"], s["off_fb"], s["y_fb"], s["t"], lse, status)

    got = grad_on(inp["dev"]).cpu()
    if tg.against_cpu:
        want = grad_on(inp)
    else:
        x = ref.scaled(inp["z"], inp["t"])
        dense = ref.dense_from_csr(inp["ids_fb"], inp["off_fb"], x.shape[1])
        want = ref.replay_grad(x, dense, inp["y_fb"], inp["t"], inp["grad"])
    return grad_problem("grad", got, want, inp["z"].dtype)


def check_full_fwd(kernels, tg: Target, inp: dict):
    d = inp["dev"]
    logp, lse = (t.cpu() for t in kernels.full_fwd(d["z"], d["y_fb"], d["t"]))
    if tg.against_cpu:
        want, ulps = kernels.full_fwd(inp["z"], inp["y_fb"], inp["t"]), DEVICE_ULPS
    else:
        want, ulps = ref.full(ref.scaled(inp["z"], inp["t"]), inp["y_fb"]), REFERENCE_ULPS
    return first_problem(ulp_problem("logp", logp, want[0], ulps), ulp_problem("lse", lse, want[1], ulps))


def check_full_bwd(kernels, tg: Target, inp: dict):
    def grad_on(s):
        _, lse = kernels.full_fwd(s["z"], s["y_fb"], s["t"])
        return kernels.full_bwd(s["grad"], s["z"], s["y_fb"], s["t"], lse)

    got = grad_on(inp["dev"]).cpu()
    if tg.against_cpu:
        want = grad_on(inp)
    else:
        want = ref.full_grad(ref.scaled(inp["z"], inp["t"]), inp["y_fb"], inp["t"], inp["grad"])
    return grad_problem("grad", got, want, inp["z"].dtype)


def check_kept_mass(kernels, tg: Target, inp: dict):
    d = inp["dev"]
    got = kernels.kept_mass(d["z"], d["ids_fb"], d["off_fb"], d["t"]).cpu()
    if tg.against_cpu:
        return ulp_problem("kept_mass", got, kernels.kept_mass(inp["z"], inp["ids_fb"], inp["off_fb"], inp["t"]),
                           DEVICE_ULPS)
    x = ref.scaled(inp["z"], inp["t"])
    want = ref.kept_mass(x, ref.dense_from_csr(inp["ids_fb"], inp["off_fb"], x.shape[1]))
    return ulp_problem("kept_mass", got, want, REFERENCE_ULPS)


# ---- replay from hidden states -----------------------------------------------------------------
def _dot_bound(inp: dict) -> float:
    """Rounding error of a float32 dot product of length d over the logits' scale: 4 sqrt(d) eps32
    |h| |w| / T (the worst case, d eps32, is never approached by random rounding and would hide real
    errors at d = 4096)."""
    h, w, t = inp["h"].double(), inp["w"].double(), inp["t"].double()
    bias = float(inp["b"].double().abs().max()) if inp["b"] is not None else 0.0
    norm = float(h.norm(dim=1).max()) * float(w.norm(dim=1).max()) + bias
    return 4 * math.sqrt(h.shape[1]) * EPS32 * norm / float(t.min())


def _bias_arg(s: dict) -> torch.Tensor:
    return s["b"] if s["b"] is not None else s["h"].new_empty((0,))


def check_hidden_fwd(kernels, tg: Target, inp: dict):
    d = inp["dev"]
    logp, lse, status = (t.cpu() for t in kernels.hidden_fwd(d["h"], d["w"], _bias_arg(d), d["ids"], d["off"],
                                                             d["y"], d["t"], True))
    if tg.against_cpu:
        want = kernels.hidden_fwd(inp["h"], inp["w"], _bias_arg(inp), inp["ids"], inp["off"], inp["y"], inp["t"], True)
        ulps = DEVICE_ULPS
    else:
        x = ref.head_scaled(inp["h"], inp["w"], inp["b"], inp["t"])
        want = ref.replay(x, ref.dense_from_csr(inp["ids"], inp["off"], x.shape[1]), inp["y"])
        ulps = REFERENCE_ULPS
    if not torch.equal(status, want[2]):
        r = _first_row(status != want[2])
        return f"status of row {r}: {int(status[r])}, expected {int(want[2][r])}"
    dots = 2 * _dot_bound(inp)  # both sides may round their dot products
    return first_problem(ulp_problem("logp", logp, want[0], ulps, dots), ulp_problem("lse", lse, want[1], ulps, dots))


def _head_grads_ref(inp: dict):
    dense = ref.dense_from_csr(inp["ids"], inp["off"], inp["w"].shape[0])
    return ref.head_grads(inp["h"], inp["w"], inp["b"], dense, inp["y"], inp["t"], inp["grad"])


def _grads_problem(got, want, dtype, normwise) -> Optional[str]:
    names = ("grad hidden", "grad weight", "grad bias")
    return first_problem(*(grad_problem(n, g, w, dtype, normwise=normwise)
                           for n, g, w in zip(names, got, want) if w is not None))


def check_hidden_bwd(kernels, tg: Target, inp: dict):
    def grads_on(s):
        _, lse, status = kernels.hidden_fwd(s["h"], s["w"], _bias_arg(s), s["ids"], s["off"], s["y"], s["t"], True)
        gh, gw, gb = kernels.hidden_bwd(s["grad"], s["h"], s["w"], _bias_arg(s), s["ids"], s["off"], s["y"], s["t"],
                                        lse, status)
        return gh, gw, (gb if s["b"] is not None else None)

    got = [g.cpu() if g is not None else None for g in grads_on(inp["dev"])]
    want = grads_on(inp) if tg.against_cpu else _head_grads_ref(inp)
    return _grads_problem(got, want, inp["h"].dtype, HEAD_GRAD_NORMWISE)


def check_sparse_grad(replay_from_hidden, tg: Target, inp: dict, mask_of):
    """The sparse-gradient LM head (torch ops on the device): log-probs and all three gradients."""
    def run_on(s, device):
        leaves = [s["h"].clone().requires_grad_(), s["w"].clone().requires_grad_(),
                  s["b"].clone().requires_grad_() if s["b"] is not None else None]
        logp = replay_from_hidden(leaves[0], leaves[1], mask_of(device), s["y"], s["t"], leaves[2], fallback=True,
                                  sparse_grad=True)
        (logp * s["grad"]).sum().backward()
        gw = leaves[1].grad
        gb = leaves[2].grad if leaves[2] is not None else None
        grads = [leaves[0].grad, gw.to_dense() if gw.is_sparse else gw, gb]
        return logp.detach().cpu(), [g.cpu() if g is not None else None for g in grads]

    logp, got = run_on(inp["dev"], tg.device)
    dtype = inp["h"].dtype
    normwise = HEAD_GRAD_NORMWISE if dtype in (torch.float32, torch.float64) else 5e-2
    if tg.against_cpu:
        want_logp, want = run_on(inp, torch.device("cpu"))
        problem = ulp_problem("logp", logp, want_logp, DEVICE_ULPS, 2 * _dot_bound(inp))
    else:
        x = ref.head_scaled(inp["h"], inp["w"], inp["b"], inp["t"])
        want_logp = ref.replay(x, ref.dense_from_csr(inp["ids"], inp["off"], x.shape[1]), inp["y"])[0]
        problem = ulp_problem("logp", logp, want_logp, REFERENCE_ULPS, 2 * _dot_bound(inp))
        want = _head_grads_ref(inp)
    return problem or _grads_problem(got, want, dtype, normwise)
