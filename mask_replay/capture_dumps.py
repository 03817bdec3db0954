"""Capture over rollout dump files: stream rows in chunks through mask_replay.capture, write one mask file.

Memory is bounded by one chunk of logits (the dumps are sliced lazily); the mask itself (int32 ids,
a few per row) and the per-row extras are accumulated and written once, atomically, at the end.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from mask_replay.dumps import PARAM_KEYS, Dump, check_finite, check_sampled, shift_row
from mask_replay import profiles
from mask_replay.io import DumpError, check_writable
from mask_replay.profiles.mismatch import DEFAULT_TOLERANCE, check_rows
from mask_replay.profiles.mismatch import summarise as mismatch_summary

# Target bytes of logits per chunk when --chunk-rows is not given.
DEFAULT_CHUNK_BYTES = 256 << 20
CARRIED_KEYS = ("step", "sequence")
SAMPLED_CHECK_ROWS = 1 << 20


@dataclass
class CaptureSummary:
    rows: int
    nnz: int
    vocab: int
    lengths: torch.Tensor  # int64 [rows], support size per row
    bytes_read: int  # logits bytes
    bytes_written: int
    seconds: float
    outside_rows: int = 0
    notes: list = field(default_factory=list)
    mask: Optional[object] = None  # the SamplingMask captured (kept for mask_replay.distributed)
    logprob_mismatch: Optional[dict] = None  # mask_replay.profiles.mismatch.summarise, with rollout_logprobs

    def stats(self) -> dict:
        """Support-size statistics and throughput, JSON-able."""
        n = max(self.rows, 1)
        ln = self.lengths.double()
        has = self.rows > 0
        return {
            "rows": self.rows,
            "nnz": self.nnz,
            "vocab": self.vocab,
            "support_mean": float(ln.mean()) if has else 0.0,
            "support_median": float(ln.median()) if has else 0.0,
            "support_p99": float(torch.quantile(ln, 0.99)) if has else 0.0,
            "support_max": int(self.lengths.max()) if has else 0,
            "singleton_share": float((self.lengths == 1).sum()) / n,
            "outside_support_rows": self.outside_rows,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "rows_per_s": self.rows / self.seconds if self.seconds > 0 else float("inf"),
            "gb_per_s": self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else float("inf"),
        }


def default_chunk_rows(vocab: int, element_size: int) -> int:
    return max(1, DEFAULT_CHUNK_BYTES // max(1, vocab * element_size))


def _param_value(dump: Dump, name: str, flags: dict, explicit: set, a: int, b: int):
    """An explicit flag wins; else the dump's own value; else the flag's default."""
    if name not in explicit and name in dump:
        v = dump.get(name) if len(dump.shape(name)) == 0 else dump.get(name, a, b)
        return v
    return flags.get(name)


def _param_source(dump: Dump, name: str, flags: dict, explicit: set):
    if name not in explicit and name in dump:
        return "dump"
    return {"source": "flag" if name in explicit else "default", "value": flags.get(name)}


def _key_of(message: str) -> str:
    for key in PARAM_KEYS + ("sampled",):
        if key in message:
            return key
    return "logits"


def capture_dumps(
    paths: list,
    out,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    explicit: frozenset = frozenset(),
    chunk_rows: Optional[int] = None,
    device: str = "cpu",
    outside: str = "error",
    progress: bool = True,
    rows: Optional[tuple] = None,
    profile: str = "exact",
    logprob_tolerance: float = DEFAULT_TOLERANCE,
) -> CaptureSummary:
    """Capture the masks of every row of `paths` (in order) into the mask file `out`.

    temperature/top_k/top_p/min_p fill rows whose dump lacks that key; names in `explicit` override
    the dump. Errors are DumpError naming the file, key and absolute row. `profile` picks whose
    support (mask_replay.profiles); dumps with rollout_logprobs are compared with it per row.
    rows=(a, b) captures only the rows [a, b) of the concatenated inputs, and out=None writes
    nothing (one rank's share under torchrun, see mask_replay.distributed).
    """
    out = os.fspath(out) if out is not None else os.devnull
    if not paths:
        raise DumpError("capture: no input files given")
    for p in paths:
        if os.path.exists(out) and os.path.exists(p) and os.path.samefile(p, out):
            raise DumpError(f"{out}: output would overwrite the input dump")
    profiles.check_profile(profile)
    if out != os.devnull:
        check_writable(out)  # fail before the long part, not after it
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}

    dumps = [Dump(p) for p in paths]
    try:
        shapes = [d.require_rollout() for d in dumps]
        vocab = shapes[0][1]
        for d, (_, v) in zip(dumps, shapes):
            if v != vocab:
                raise d.err("logits", f"vocab size {v} does not match {vocab} of {dumps[0].path}")
        total = sum(n for n, _ in shapes)
        for d, (n, _) in zip(dumps, shapes):  # cheap, and better now than after hours of capture
            for a in range(0, n, SAMPLED_CHECK_ROWS):
                b = min(n, a + SAMPLED_CHECK_ROWS)
                check_sampled(d, d.get("sampled", a, b), vocab, a)
        carried = [k for k in CARRIED_KEYS if all(k in d for d in dumps)]
        notes = [f"'{k}' is missing from some inputs: not carried" for k in CARRIED_KEYS
                 if k not in carried and any(k in d for d in dumps)]
        engine_lp = [("rollout_logprobs" in d) for d in dumps]

        from tqdm import tqdm

        parts, bytes_read, t0 = [], 0, time.perf_counter()
        # closed (and cleared) on errors too, so an error line never lands after a half-drawn bar
        with tqdm(total=total, unit="rows", desc="capture", disable=not progress or None, leave=False) as bar:
            first = 0  # global row of the file's row 0
            for d, (n, _), has_lp in zip(dumps, shapes, engine_lp):
                lo, hi = (0, n) if rows is None else (max(0, rows[0] - first), min(n, rows[1] - first))
                first += n
                step = chunk_rows or max(1, default_chunk_rows(vocab, torch.empty(0, dtype=d.dtype("logits")).element_size())
                                         // profiles.CHUNK_DIVISOR[profile])
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    parts.append(_capture_chunk(d, a, b, flags, explicit, device, outside, has_lp, carried,
                                                profile, logprob_tolerance, any(engine_lp)))
                    bytes_read += d.nbytes("logits") * (b - a) // max(n, 1)
                    bar.update(b - a)

        mask = _concat(parts, carried, outside)
        mask.metadata = {
            "vocab_size": vocab,
            "sources": [os.path.basename(d.path) for d in dumps],
            "params": {os.path.basename(d.path): {k: _param_source(d, k, flags, explicit) for k in PARAM_KEYS}
                       for d in dumps},
            "logprobs_source": {os.path.basename(d.path): "rollout_logprobs" if h else "computed"
                                for d, h in zip(dumps, engine_lp)},
            "outside": outside,
            "semantics": profiles.semantics(profile),
        }
        mismatch = None
        if any(engine_lp):
            mismatch = mismatch_summary(mask.extras["logprob_mismatch"], mask.logprobs,
                                        mask.extras["capture_logprobs"], logprob_tolerance)
            mask.metadata["logprob_mismatch"] = mismatch
        if out != os.devnull:
            mask.save(out)
        seconds = time.perf_counter() - t0
    finally:
        for d in dumps:
            d.close()
    outside_rows = int(mask.extras["outside_support"].sum()) if "outside_support" in mask.extras else 0
    written = os.path.getsize(out) if out != os.devnull else 0
    return CaptureSummary(mask.num_rows, mask.nnz, vocab, mask.lengths(), bytes_read, written, seconds,
                          outside_rows, notes, mask, mismatch)


def _capture_chunk(d: Dump, a, b, flags, explicit, device, outside, has_lp, carried, profile, tol, compare):
    import mask_replay

    logits = d.get("logits", a, b)
    sampled = d.get("sampled", a, b).to(torch.int64)
    params = {k: _param_value(d, k, flags, explicit, a, b) for k in PARAM_KEYS}
    if device != "cpu":
        logits, sampled = logits.to(device), sampled.to(device)
        params = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    try:
        m = mask_replay.capture(logits, sampled=sampled, outside=outside, profile=profile, **params)
    except (RuntimeError, ValueError) as exc:
        # Name the defect precisely when it is in the logits; else keep the op's own words,
        # with its chunk-relative row made absolute.
        check_finite(d, logits, a)
        raise DumpError(f"{d.path}: key '{_key_of(str(exc))}': {shift_row(str(exc), a)}") from exc
    m = m.to("cpu")
    t = params["temperature"]
    temp = t.to(torch.float32).cpu().reshape(-1).expand(b - a) if isinstance(t, torch.Tensor) else \
        torch.full((b - a,), float(t), dtype=torch.float32)
    extras = {"temperature": temp.contiguous(), "capture_logprobs": m.logprobs}
    extras["logprobs"] = d.get("rollout_logprobs", a, b).to(torch.float32) if has_lp else m.logprobs
    for k in carried:
        extras[k] = d.get(k, a, b).to(torch.int64)
    extras["outside_support"] = m.extras.get("outside_support", torch.zeros(b - a, dtype=torch.bool)).cpu()
    if compare:  # per-row cause codes; -1 for rows whose dump has no rollout_logprobs
        extras["logprob_mismatch"] = check_rows(logits, sampled, params["temperature"], extras["logprobs"],
                                                m.logprobs, tol) if has_lp else torch.full((b - a,), -1, dtype=torch.int8)
    return m, extras


def _concat(parts, carried, outside):
    from mask_replay.mask import SamplingMask

    masks = []
    for m, ex in parts:
        masks.append(SamplingMask(m.token_ids, m.offsets, m.sampled, ex["logprobs"], m.kept_mass,
                                  {k: v for k, v in ex.items() if k != "logprobs"}))
    mask = SamplingMask.concat(masks) if masks else SamplingMask.concat([])
    if not masks:  # no rows at all: an empty mask still carries empty per-row keys
        mask.sampled = torch.zeros(0, dtype=torch.int64)
        mask.logprobs = torch.zeros(0)
        mask.kept_mass = torch.zeros(0)
        mask.extras = {"temperature": torch.zeros(0), "capture_logprobs": torch.zeros(0)}
        mask.extras.update({k: torch.zeros(0, dtype=torch.int64) for k in carried})
    if outside == "error" or not bool(mask.extras.get("outside_support", torch.zeros(0, dtype=torch.bool)).any()):
        mask.extras.pop("outside_support", None)  # only written when some row was flagged
    return mask
