"""`mask_replay.selftest()`: every op on a device against the CPU kernels, or, without a GPU, the CPU
kernels against the float64 PyTorch references, on a matrix of cases that reaches every kernel path.

    result = mask_replay.selftest(device="cuda", quick=True)   # one record per case
    assert result.ok, result.failures

The matrix: shapes from one row of a 151936- or 262144-token vocabulary to 2048 rows of 1000 and
256 rows of 151936 (smaller ones on the CPU, where the reference is a Python loop over rows);
float32, bfloat16, float16; greedy, temperature only (full-vocabulary rows), top-k (1, 50, 20000),
top-p (0.5, 0.95, 0.999: wide supports), min-p, all at once and per-row mixtures; logits shaped like
an LLM's, nearly flat, heavily tied (few distinct values) or with -inf columns. Per case one op:
capture, capture_fixed, replay_fwd (with and without fallback rows), replay_bwd, full_fwd,
full_bwd, kept_mass, hidden_fwd, hidden_bwd, and the sparse-gradient LM head (a token in every row
included). Tolerances: mask_replay/tools/selftest_checks.py.

A CUDA error is sticky (every later call fails with it), so the first one ends the run and names
its case; CUDA_LAUNCH_BLOCKING=1 is set when CUDA has not been initialised yet, so that the error
surfaces at the launch that caused it.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

# From the package root (imported by its __init__ after both are defined there): no module paths.
from mask_replay.mask import SamplingMask
from mask_replay.params import expand_params
from mask_replay.tools import selftest_checks as checks
from mask_replay.tools.selftest_checks import Lazy, Target
from mask_replay.trainer.replay import replay_logprobs_from_hidden

# The ops under test, looked up when a case runs (a test swaps in a broken op to see a check fail).
KERNELS = torch.ops.mask_replay
# The sparse-gradient LM head is torch code, not a kernel; looked up the same way.
SPARSE_HEAD = replay_logprobs_from_hidden

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "T=0.7": dict(temperature=0.7),  # no filter: every finite token, the widest rows
    "top_k=1": dict(top_k=1),
    "top_k=50": dict(top_k=50),
    "top_k=20000": dict(top_k=20000),  # a wide top-k
    "top_p=0.95": dict(top_p=0.95),
    "top_p=0.999": dict(top_p=0.999),  # a wide top-p
    "min_p=0.05": dict(min_p=0.05),
    "T=0.7 k=50 p=0.9 mp=0.05": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    "T=1.3 p=0.5": dict(temperature=1.3, top_p=0.5),
    "per-row mix": "per-row",
}
QUICK_CONFIGS = ("greedy", "top_k=50", "top_p=0.95", "top_p=0.999", "T=0.7 k=50 p=0.9 mp=0.05", "per-row mix")
TIE_CONFIGS = ("top_k=1", "top_k=50", "top_p=0.5-ties", "top_p=0.999", "min_p=0.5")
TIE_EXTRA = {"top_p=0.5-ties": dict(top_p=0.5), "min_p=0.5": dict(min_p=0.5)}
REPLAY_MASKS = {"narrow": dict(top_k=50, top_p=0.9), "wide": dict(top_p=0.999)}
FIXED_WIDTH = 64
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Matrix:
    """Which groups of cases run: (rows, vocab) shapes, dtypes, configs; hidden as (rows, d, vocab, hot)."""
    shapes: tuple
    dtypes: tuple
    configs: tuple
    tie_shapes: tuple
    neg_inf_shape: tuple
    flat_shape: tuple
    replay_shapes: tuple
    hidden: tuple


FULL = torch.float32, torch.bfloat16, torch.float16
MATRICES = {
    ("device", False): Matrix(
        shapes=((1, 151936), (1, 262144), (3, 5000), (7, 32000), (256, 151936), (2048, 1000)), dtypes=FULL,
        configs=tuple(CONFIGS), tie_shapes=((16, 5000), (2048, 1000)), neg_inf_shape=(5, 40000),
        flat_shape=(64, 151936), replay_shapes=((1, 151936), (1, 262144), (7, 32000), (256, 151936), (2048, 1000)),
        hidden=((64, 256, 32000, False), (1024, 1024, 151936, True))),
    ("device", True): Matrix(
        shapes=((1, 151936), (1, 262144), (7, 32000), (256, 151936), (2048, 1000)),
        dtypes=(torch.float32, torch.bfloat16), configs=QUICK_CONFIGS, tie_shapes=((2048, 1000),),
        neg_inf_shape=(5, 40000), flat_shape=(64, 151936), replay_shapes=((1, 151936), (256, 151936), (2048, 1000)),
        hidden=((64, 256, 32000, False), (256, 512, 151936, True))),
    ("cpu", False): Matrix(
        shapes=((1, 20000), (3, 5000), (16, 2000), (128, 300)), dtypes=FULL, configs=tuple(CONFIGS),
        tie_shapes=((8, 2000),), neg_inf_shape=(4, 3000), flat_shape=(4, 8000),
        replay_shapes=((1, 20000), (16, 2000), (128, 300)), hidden=((16, 32, 500, True), (48, 64, 2000, False))),
    ("cpu", True): Matrix(
        shapes=((1, 3000), (6, 1000), (40, 200)), dtypes=(torch.float32, torch.bfloat16), configs=QUICK_CONFIGS,
        tie_shapes=((6, 500),), neg_inf_shape=(3, 1000), flat_shape=(2, 3000), replay_shapes=((6, 1000), (40, 200)),
        hidden=((12, 16, 300, True),)),
}


@dataclass
class CaseResult:
    name: str
    op: str
    status: str  # "ok", "mismatch" (the check failed) or "error" (the case raised)
    detail: str  # what differs, or the exception; "" when ok
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class SelftestResult:
    device: str
    expectation: str  # what the device's results were compared with
    quick: bool
    launch_blocking: bool  # CUDA_LAUNCH_BLOCKING was in force (CUDA runs only)
    cases: list = field(default_factory=list)
    stopped_at: Optional[str] = None  # the case whose CUDA error ended the run
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.stopped_at is None and bool(self.cases) and all(c.ok for c in self.cases)

    @property
    def failures(self) -> list:
        return [c for c in self.cases if not c.ok]

    def by_op(self) -> dict:
        """op -> {"cases", "ok", "mismatch", "error", "seconds"}, in the order the ops first ran."""
        out: dict = {}
        for c in self.cases:
            row = out.setdefault(c.op, {"cases": 0, "ok": 0, "mismatch": 0, "error": 0, "seconds": 0.0})
            row["cases"] += 1
            row[c.status] += 1
            row["seconds"] += c.seconds
        return out


@dataclass
class Case:
    name: str
    op: str
    run: Callable[[], Optional[str]]


# ---- inputs ------------------------------------------------------------------------------------
PATTERNS = ("llm", "flat", "ties", "neg_inf")


def make_logits(n: int, v: int, dtype: torch.dtype, pattern: str) -> torch.Tensor:
    """Deterministic logits [n, v] on the CPU. llm: a Gaussian body and a few much larger logits per
    row (peaked, like a language model's); flat: nearly uniform (wide top-p supports); ties: nine
    distinct values (huge tie groups at every threshold); neg_inf: llm with every third column -inf."""
    g = torch.Generator().manual_seed(n * 1_000_003 + v * 7 + PATTERNS.index(pattern) * 101
                                       + list(DTYPE_NAMES).index(dtype))
    if pattern == "ties":
        z = torch.randint(-4, 5, (n, v), generator=g).float() * 0.5
    elif pattern == "flat":
        z = torch.randn(n, v, generator=g) * 0.3
    else:
        z = torch.randn(n, v, generator=g) * 2.0
        hot = torch.randint(v, (n, min(8, v)), generator=g)
        z.scatter_(1, hot, 8.0 + 4.0 * torch.rand(n, min(8, v), generator=g))
        if pattern == "neg_inf":
            z[:, ::3] = float("-inf")
            z[:, min(1, v - 1)] = 0.0  # every row keeps a finite logit
    return z.to(dtype)


def per_row_mix(n: int):
    """Each row another configuration (greedy, full, top-k, top-p, min-p, everything)."""
    cycle = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
             (1.2, 0, 1.0, 0.1), (0.7, 40, 0.95, 0.02), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.999, 0.0)]
    rows = [cycle[r % len(cycle)] for r in range(n)]
    t, k, p, mp = zip(*rows)
    return dict(temperature=torch.tensor(t), top_k=torch.tensor(k), top_p=torch.tensor(p, dtype=torch.float64),
                min_p=torch.tensor(mp, dtype=torch.float64))


def config_kwargs(name: str, n: int) -> dict:
    cfg = CONFIGS.get(name) or TIE_EXTRA[name]
    return per_row_mix(n) if cfg == "per-row" else cfg


def label(n: int, v: int, dtype: torch.dtype, pattern: str = "llm") -> str:
    return f"{n}x{v} {DTYPE_NAMES[dtype]}" + ("" if pattern == "llm" else f" {pattern}")


# ---- groups of cases (inputs made when a group's first case runs, dropped after its last) -------
def capture_group(tg: Target, n: int, v: int, dtype, pattern: str, configs) -> Iterator[Case]:
    z = Lazy(lambda: make_logits(n, v, dtype, pattern))
    zd = Lazy(lambda: z().to(tg.device))
    where = label(n, v, dtype, pattern)
    for name in configs:
        kw = config_kwargs(name, n)
        params = Lazy(functools.partial(expand_params, n, "cpu", kw.get("temperature", 1.0), kw.get("top_k"),
                                        kw.get("top_p"), kw.get("min_p")))
        params_d = Lazy(lambda params=params: [t.to(tg.device) for t in params()])
        bounds = Lazy(lambda params=params: checks.ref.support(z(), *params()))
        yield Case(f"capture {where} {name}", "capture",
                   lambda p=params, pd=params_d, b=bounds: checks.check_capture(KERNELS, tg, z(), zd(), p(), pd(), b))
        yield Case(f"capture_fixed {where} {name} width={FIXED_WIDTH}", "capture_fixed",
                   lambda p=params, pd=params_d, b=bounds: checks.check_capture_fixed(KERNELS, tg, z(), zd(), p(), pd(),
                                                                                     b, FIXED_WIDTH))


def _sampled_inside(ids, offsets, g) -> torch.Tensor:
    lengths = offsets.diff()
    pick = offsets[:-1] + (torch.rand(lengths.numel(), generator=g) * lengths).long().clamp_max(lengths - 1)
    return ids[pick].long()


def replay_inputs(tg: Target, z: torch.Tensor, mask_cfg: dict) -> dict:
    """A captured mask (one row emptied when there are three or more), sampled tokens inside it except
    every fourth row (outside: a fallback row), per-row temperatures and incoming gradients."""
    n, v = z.shape
    g = torch.Generator().manual_seed(n + v)
    ids, offsets, _ = KERNELS.capture(z, *expand_params(n, "cpu", 1.0, mask_cfg.get("top_k"),
                                                        mask_cfg.get("top_p"), None), False)
    y_in = _sampled_inside(ids, offsets, g)
    y_fb = y_in.clone()
    lengths = offsets.diff()
    dense = checks.ref.dense_from_csr(ids, offsets, v)
    for r in range(1, n, 4):
        if int(lengths[r]) < v:
            y_fb[r] = int(torch.multinomial((~dense[r]).float(), 1, generator=g))
    ids_fb, off_fb = ids, offsets
    if n >= 3:  # row 2 empty: the other fallback
        lo, hi = int(offsets[2]), int(offsets[3])
        ids_fb = torch.cat([ids[:lo], ids[hi:]])
        off_fb = torch.cat([offsets[:3], offsets[3:] - (hi - lo)])
    inp = dict(z=z, ids=ids, off=offsets, y_in=y_in, ids_fb=ids_fb, off_fb=off_fb, y_fb=y_fb,
               t=(0.6 + 0.8 * torch.rand(n, generator=g)).float(),
               grad=torch.linspace(0.5, 1.5, n, dtype=torch.float32))
    inp["dev"] = {k: val.to(tg.device) for k, val in inp.items()}
    return inp


def replay_group(tg: Target, n: int, v: int, dtype, masks) -> Iterator[Case]:
    where = label(n, v, dtype)
    z = Lazy(lambda: make_logits(n, v, dtype, "llm"))
    for mask_name in masks:
        inp = Lazy(lambda m=mask_name: replay_inputs(tg, z(), REPLAY_MASKS[m]))
        tail = f"{where} {mask_name} supports"
        yield Case(f"replay_fwd {tail} fallback", "replay_fwd",
                   lambda i=inp: checks.check_replay_fwd(KERNELS, tg, i(), True))
        yield Case(f"replay_fwd {tail}", "replay_fwd", lambda i=inp: checks.check_replay_fwd(KERNELS, tg, i(), False))
        yield Case(f"replay_bwd {tail} fallback", "replay_bwd", lambda i=inp: checks.check_replay_bwd(KERNELS, tg, i()))
        yield Case(f"kept_mass {tail}", "kept_mass", lambda i=inp: checks.check_kept_mass(KERNELS, tg, i()))
    inp = Lazy(lambda: replay_inputs(tg, z(), REPLAY_MASKS[masks[0]]))
    yield Case(f"full_fwd {where}", "full_fwd", lambda: checks.check_full_fwd(KERNELS, tg, inp()))
    yield Case(f"full_bwd {where}", "full_bwd", lambda: checks.check_full_bwd(KERNELS, tg, inp()))


def hidden_inputs(tg: Target, n: int, d: int, v: int, dtype, hot: bool, bias: bool) -> dict:
    """An LM head, random supports of 1-24 tokens (token 13 in every row when hot: one long run of
    rows for the weight gradient). In float32, fallback rows too: row 1 empty, every fifth row's
    token outside its support. (A fallback row projects its whole row with a matmul in the input's
    dtype, which rounds every bf16/fp16 logit: no ulp-level comparison holds there, and that matmul
    is torch's, the same code on every device.)"""
    fallback = dtype == torch.float32
    g = torch.Generator().manual_seed(n * 31 + d + v)
    rows, ys = [], []
    for r in range(n):
        k = int(torch.randint(1, 25, (), generator=g))
        ids = set(torch.randint(v, (k,), generator=g).tolist()) | ({13} if hot else set())
        row = sorted(ids) if r != 1 or not fallback else []
        y = row[int(torch.randint(len(row), (), generator=g))] if row else 0
        if r % 5 == 3 and fallback:
            while y in ids:
                y = int(torch.randint(v, (), generator=g))
        rows.append(row)
        ys.append(y)
    mask = SamplingMask.from_lists(rows)
    inp = dict(h=torch.randn(n, d, generator=g).to(dtype), w=(torch.randn(v, d, generator=g) * 2 / d ** 0.5).to(dtype),
               b=(torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None,
               ids=mask.token_ids, off=mask.offsets, y=torch.tensor(ys, dtype=torch.int64),
               t=(0.6 + 0.8 * torch.rand(n, generator=g)).float(), grad=torch.linspace(0.5, 1.5, n))
    inp["dev"] = {k: (val.to(tg.device) if val is not None else None) for k, val in inp.items()}
    inp["mask"] = mask
    return inp


def hidden_group(tg: Target, n: int, d: int, v: int, hot: bool, dtypes) -> Iterator[Case]:
    for dtype in dtypes:
        bias = dtype == torch.float32  # one dtype with a bias, the others without
        inp = Lazy(lambda dt=dtype, b=bias: hidden_inputs(tg, n, d, v, dt, hot, b))
        where = f"{n}x{d} -> {v} {DTYPE_NAMES[dtype]}{' bias' if bias else ''}{' hot token' if hot else ''}"
        yield Case(f"hidden_fwd {where}", "hidden_fwd", lambda i=inp: checks.check_hidden_fwd(KERNELS, tg, i()))
        yield Case(f"hidden_bwd {where}", "hidden_bwd", lambda i=inp: checks.check_hidden_bwd(KERNELS, tg, i()))
        yield Case(f"sparse_grad {where}", "sparse_grad",
                   lambda i=inp: checks.check_sparse_grad(SPARSE_HEAD, tg, i(), lambda dev, i=i: i()["mask"].to(dev)))


def all_groups(tg: Target, m: Matrix) -> Iterator[Iterator[Case]]:
    for n, v in m.shapes:
        for dtype in m.dtypes:
            yield capture_group(tg, n, v, dtype, "llm", m.configs)
    for n, v in m.tie_shapes:
        for dtype in m.dtypes:
            yield capture_group(tg, n, v, dtype, "ties", TIE_CONFIGS)
    # float16 here in every matrix: the quick ones reach the half-precision loads through this group
    yield capture_group(tg, *m.neg_inf_shape, torch.float16, "neg_inf", ("T=0.7", "top_p=0.95", "top_k=20000",
                                                                        "min_p=0.05"))
    yield capture_group(tg, *m.flat_shape, m.dtypes[0], "flat", ("top_p=0.95", "top_p=0.999", "T=1.3 p=0.5"))
    for n, v in m.replay_shapes:
        for dtype in m.dtypes:
            yield replay_group(tg, n, v, dtype, tuple(REPLAY_MASKS))
    for n, d, v, hot in m.hidden:
        yield hidden_group(tg, n, d, v, hot, m.dtypes)


# ---- the run -----------------------------------------------------------------------------------
def is_cuda_error(exc: BaseException) -> bool:
    accelerator = getattr(torch, "AcceleratorError", None)
    text = str(exc)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return "CUDA error" in text or "illegal memory" in text


def resolve_device(device: Optional[str]) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"selftest: device {device}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"selftest: device {device}: no CUDA device is visible (torch {torch.__version__})")
    return dev


def selftest(device: Optional[str] = None, *, quick: bool = False, only: Optional[str] = None,
             progress: Optional[Callable[[CaseResult], None]] = None) -> SelftestResult:
    """Run the self-test; returns a SelftestResult (one CaseResult per case, `.ok` when all pass).

    device: "cuda" (or "cuda:N") checks that device's kernels against the CPU kernels; "cpu" checks
    the CPU kernels against the float64 references; None or "auto": cuda when visible, else cpu.
    quick: the reduced matrix (under a minute on one H100/H200; a few seconds on a CPU).
    only: run just the cases whose name contains this text. progress: called after every case.
    """
    dev = resolve_device(device)
    blocking = False
    if dev.type == "cuda":
        if not torch.cuda.is_initialized():  # read when CUDA initialises; later it changes nothing
            os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    tg = Target(dev, against_cpu=dev.type != "cpu")
    matrix = MATRICES[("device" if tg.against_cpu else "cpu", quick)]
    result = SelftestResult(str(dev), tg.expectation, quick, blocking)
    return run_cases(tg, matrix, result, only=only, progress=progress)


def run_cases(tg: Target, matrix: Matrix, result: SelftestResult, *, only: Optional[str] = None,
              progress: Optional[Callable[[CaseResult], None]] = None) -> SelftestResult:
    """Runs the matrix's cases into `result`; on a device run, the first CUDA error ends it."""
    start = time.perf_counter()
    for group in all_groups(tg, matrix):
        for case in group:
            if only and only not in case.name:
                continue
            t0 = time.perf_counter()
            try:
                problem = case.run()
                status, detail = ("mismatch", problem) if problem else ("ok", "")
            except Exception as exc:  # a case that raises is a failure of that case, reported with its name
                status, detail = "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                if tg.against_cpu and is_cuda_error(exc):  # sticky: every later case would only repeat it
                    result.stopped_at = case.name
            record = CaseResult(case.name, case.op, status, detail, time.perf_counter() - t0)
            result.cases.append(record)
            if progress:
                progress(record)
            if result.stopped_at:
                result.seconds = time.perf_counter() - start
                return result
    result.seconds = time.perf_counter() - start
    return result
