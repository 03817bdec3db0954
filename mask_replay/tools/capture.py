"""Capture over rollout dump files: stream rows in chunks through mask_replay.capture, write one mask file.

Memory is bounded by one chunk, whatever the support widths: logits are read chunk by chunk (pread,
see dumps.py), and each chunk's mask goes straight into the output file (safetensors_stream.StreamWriter:
per-row keys at their place, `token_ids` appended, the header written last). What stays in memory
for the whole run is 9 bytes per row (support sizes for the summary, the outside-support flags).
The file is built under a temp name and renamed onto the output only when complete.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm import tqdm

from mask_replay import errors
from mask_replay.errors import DumpError, OutsideSupportError
from mask_replay.files.dumps import PARAM_KEYS, Dump, check_finite, check_sampled, default_chunk_rows
from mask_replay.files.identity import file_identity, source_names
from mask_replay.files.mask_file import MaskSink, MemorySink
from mask_replay.files.safe_output import atomic_file, check_distinct, check_writable
from mask_replay.params import expand_params
from mask_replay.sampler import profiles
from mask_replay.sampler.capture import capture
from mask_replay.sampler.profiles.mismatch import DEFAULT_TOLERANCE, check_rows
from mask_replay.sampler.profiles.mismatch import summarise as mismatch_summary

MASK_ENTRY_BYTES = 4  # an int32 support id: the widest mask keeps every token of a row
CARRIED_KEYS = ("step", "sequence")
SAMPLED_CHECK_ROWS = 1 << 20


@dataclass
class CaptureSummary:
    rows: int
    nnz: int
    vocab: int
    lengths: torch.Tensor  # int32 [rows], support size per row (4 bytes a row for the whole run)
    bytes_read: int  # logits bytes
    bytes_written: int
    seconds: float
    outside_rows: int = 0
    notes: list = field(default_factory=list)
    mask: Optional[object] = None  # the SamplingMask captured (kept for mask_replay.distributed)
    logprob_mismatch: Optional[dict] = None  # mask_replay.sampler.profiles.mismatch.summarise, with rollout_logprobs

    def stats(self) -> dict:
        """Support-size statistics and throughput, JSON-able."""
        n = max(self.rows, 1)
        has = self.rows > 0
        # one sorted int32 copy, no float64 one (torch.quantile also refuses more than 2^24 values):
        # the lower median as torch.median gives it, the 99th percentile interpolated as torch.quantile
        ln = torch.sort(self.lengths).values if has else self.lengths
        pos = 0.99 * (self.rows - 1)
        lo = int(pos)
        p99 = float(ln[lo]) + (float(ln[min(lo + 1, self.rows - 1)]) - float(ln[lo])) * (pos - lo) if has else 0.0
        return {
            "rows": self.rows,
            "nnz": self.nnz,
            "vocab": self.vocab,
            "support_mean": float(self.lengths.sum(dtype=torch.int64)) / n if has else 0.0,
            "support_median": float(ln[(self.rows - 1) // 2]) if has else 0.0,
            "support_p99": p99,
            "support_max": int(ln[-1]) if has else 0,
            "singleton_share": float((self.lengths == 1).sum()) / n,
            "outside_support_rows": self.outside_rows,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "rows_per_s": self.rows / self.seconds if self.seconds > 0 else float("inf"),
            "gb_per_s": self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else float("inf"),
        }


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


@dataclass
class _Job:
    """What every chunk of one capture shares."""

    flags: dict  # the sampling flags: values for rows whose dump lacks the key
    explicit: frozenset  # flags given explicitly: they override the dumps
    device: str
    outside: str
    profile: str
    tolerance: float
    carried: list  # per-row keys copied from every dump into the mask file
    compare: bool  # some dump has rollout_logprobs: compare them with the captured support's
    entries: bool = False  # write entry_logprobs (every support entry's log-prob, [nnz])


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
    entry_logprobs: bool = False,
) -> CaptureSummary:
    """Capture the masks of every row of `paths` (in order) into the mask file `out`.

    temperature/top_k/top_p/min_p fill rows whose dump lacks that key; names in `explicit` override
    the dump. Errors are DumpError naming the file, key and absolute row. `profile` picks whose
    support (mask_replay.sampler.profiles); dumps with rollout_logprobs are compared with it per row.
    rows=(a, b) captures only the rows [a, b) of the concatenated inputs, and out=None writes
    nothing (one rank's share under torchrun, see tools/torchrun.py). entry_logprobs=True also writes
    every support entry's log-prob (key `entry_logprobs`, streamed like token_ids: memory stays bounded).
    """
    out = os.fspath(out) if out is not None else None
    if not paths:
        raise DumpError("capture: no input files given")
    profiles.check_profile(profile)
    if out is not None:
        check_distinct([("dump", p) for p in paths], [("the output", out)])
        check_writable(out)  # fail before the long part, not after it
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    with contextlib.ExitStack() as stack:
        dumps = [stack.enter_context(Dump(p)) for p in paths]
        shapes, vocab = _check_inputs(dumps)
        carried = [k for k in CARRIED_KEYS if all(k in d for d in dumps)]
        notes = [f"'{k}' is missing from some inputs: not carried" for k in CARRIED_KEYS
                 if k not in carried and any(k in d for d in dumps)]
        job = _Job(flags, explicit, device, outside, profile, logprob_tolerance, carried,
                   any("rollout_logprobs" in d for d in dumps), bool(entry_logprobs))
        metadata = _mask_metadata(dumps, vocab, job)
        total = sum(n for n, _ in shapes)
        lo_row, hi_row = (0, total) if rows is None else (max(0, rows[0]), min(total, rows[1]))
        return _capture_rows(dumps, shapes, vocab, job, metadata, out, lo_row, hi_row, chunk_rows, progress, notes)


def _check_inputs(dumps: list):
    """(rows, vocab) of each dump, and the one vocabulary; sampled ids checked against it up front:
    cheap, and better now than after hours of capture."""
    shapes = [d.require_rollout() for d in dumps]
    vocab = shapes[0][1]
    for d, (n, v) in zip(dumps, shapes):
        if v != vocab:
            raise d.err("logits", f"vocab size {v} does not match {vocab} of {dumps[0].path}")
        for a in range(0, n, SAMPLED_CHECK_ROWS):
            b = min(n, a + SAMPLED_CHECK_ROWS)
            check_sampled(d, d.get("sampled", a, b), vocab, a)
    return shapes, vocab


def _mask_metadata(dumps: list, vocab: int, job: _Job) -> dict:
    names = source_names([d.path for d in dumps])
    return {
        "vocab_size": vocab,
        "sources": names,
        "inputs": [file_identity(d.path) for d in dumps],  # what --resume compares (files/identity.py)
        "params": {name: {k: _param_source(d, k, job.flags, job.explicit) for k in PARAM_KEYS}
                   for name, d in zip(names, dumps)},
        "logprobs_source": {name: "rollout_logprobs" if "rollout_logprobs" in d else "computed"
                            for name, d in zip(names, dumps)},
        "outside": job.outside,
        "semantics": profiles.semantics(job.profile),
    }


def _capture_rows(dumps, shapes, vocab, job: _Job, metadata, out, lo_row, hi_row, chunk_rows, progress, notes):
    """The chunk loop over rows [lo_row, hi_row) of the concatenated dumps, into a sink (the mask file,
    or memory when out is None). Only O(rows) values stay in memory for the summary and the report."""
    count = max(0, hi_row - lo_row)
    bytes_read, t0 = 0, time.perf_counter()
    lengths = torch.empty(count, dtype=torch.int32)  # a support has fewer than 2^31 ids
    flagged = torch.zeros(count, dtype=torch.bool)
    # the log-prob comparison's per-row values, for the whole run only when there is one
    compared = count if job.compare else 0
    codes = torch.full((compared,), -1, dtype=torch.int8)  # log-prob mismatch cause per row
    engine_lps, capture_lps = torch.zeros(compared), torch.zeros(compared)
    with (atomic_file(out) if out is not None else contextlib.nullcontext()) as f:
        sink = MaskSink(f, count, vocab, job.carried, job.outside, metadata, job.compare, job.entries) \
            if out is not None else MemorySink(job.carried, job.outside, metadata, job.compare, job.entries)
        # closed (and cleared) on errors too, so an error line never lands after a half-drawn bar
        with tqdm(total=count, unit="rows", desc="capture", disable=not progress or None, leave=False) as bar:
            row, first = 0, 0  # row: written so far; first: global row of the file's row 0
            switches = _engine_batch_switches(dumps, shapes, vocab, job) if hi_row > lo_row else {}
            for d, (n, _) in zip(dumps, shapes):
                lo, hi = max(0, lo_row - first), min(n, hi_row - first)
                first += n
                step = chunk_rows or max(1, default_chunk_rows(vocab, d.dtype("logits").itemsize + MASK_ENTRY_BYTES)
                                         // profiles.CHUNK_DIVISOR[job.profile])
                at = first - n  # this file's row 0 in the switches of all inputs
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    m, extras = _capture_chunk(d, a, b, job, {k: v[at + a:at + b] for k, v in switches.items()})
                    sink.write(row, m, extras)
                    span = slice(row, row + b - a)
                    lengths[span], flagged[span] = m.lengths(), extras["outside_support"]
                    if job.compare:
                        codes[span] = extras["logprob_mismatch"]
                        engine_lps[span], capture_lps[span] = extras["logprobs"], extras["capture_logprobs"]
                    row += b - a
                    bytes_read += d.nbytes("logits") * (b - a) // max(n, 1)
                    bar.update(b - a)
        mismatch = mismatch_summary(codes, engine_lps, capture_lps, job.tolerance) if job.compare else None
        mask = sink.finish(flagged, codes if job.compare else None, mismatch)
        bytes_written = 0
        if f is not None:
            f.seek(0, os.SEEK_END)
            bytes_written = f.tell()
    seconds = time.perf_counter() - t0
    return CaptureSummary(count, int(lengths.sum()), vocab, lengths, bytes_read, bytes_written, seconds,
                          int(flagged.sum()), notes, mask, mismatch)


def _engine_batch_switches(dumps: list, shapes: list, vocab: int, job: _Job) -> dict:
    """The engine profile's batch-wide choices for every row of all inputs, decided over whole engine
    batches, never over a chunk, a rank's share or an input file: `batch` ids are global across the
    inputs (a capture of several files gives the masks of a capture of their concatenation), and
    without any `batch` key each file is one batch. The per-row parameters are read whole (a few
    bytes per row) once."""
    if job.profile == "exact":
        return {}
    with_key = [d for d in dumps if "batch" in d]
    if with_key and len(with_key) != len(dumps):
        lacking = next(d for d in dumps if "batch" not in d)
        raise DumpError(f"no 'batch' key while {with_key[0].path} has one: engine batch ids are global across "
                        "the inputs, so every input needs them", file=lacking.path, key="batch")
    params, batches = [], []
    for i, (d, (n, _)) in enumerate(zip(dumps, shapes)):
        prm = {k: _param_value(d, k, job.flags, job.explicit, 0, n) for k in PARAM_KEYS}
        batch = d.get("batch").to(torch.int64) if with_key else torch.full((n,), i, dtype=torch.int64)
        try:  # each file's own checks first, so that an error names its file and row
            profiles.batch_switches(job.profile, n, vocab, **prm, batch=batch)
        except ValueError as exc:
            raise errors.from_op_error(exc, keys=PARAM_KEYS, default_key="batch").at(file=d.path, cls=DumpError) \
                from exc
        params.append((n, prm))
        batches.append(batch)
    if len(dumps) == 1:
        return profiles.batch_switches(job.profile, shapes[0][0], vocab, **params[0][1], batch=batches[0])
    # one parameter tensor over all rows, each file's rows expanded (a scalar or an absent filter
    # becomes its per-row value); a filter no input sets stays off (None) for all
    rows = [expand_params(n, "cpu", *(prm[k] for k in PARAM_KEYS)) for n, prm in params]
    merged = {k: None if all(prm[k] is None for _, prm in params) else torch.cat([r[i] for r in rows])
              for i, k in enumerate(PARAM_KEYS)}
    return profiles.batch_switches(job.profile, sum(n for n, _ in params), vocab, **merged, batch=torch.cat(batches))


def _capture_chunk(d: Dump, a: int, b: int, job: _Job, switches: Optional[dict] = None):
    flags, explicit, device, outside, profile = job.flags, job.explicit, job.device, job.outside, job.profile
    has_lp, carried, compare, tol = "rollout_logprobs" in d, job.carried, job.compare, job.tolerance
    logits = d.get("logits", a, b, stream=True)  # released when the next chunk is read
    sampled = d.get("sampled", a, b).to(torch.int64)
    params = {k: _param_value(d, k, flags, explicit, a, b) for k in PARAM_KEYS}
    if device != "cpu":
        logits, sampled = logits.to(device), sampled.to(device)
        params = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    try:
        m = capture(logits, sampled=sampled, outside=outside, profile=profile, entry_logprobs=job.entries,
                    switches=switches or None, **params)
    except (RuntimeError, ValueError) as exc:
        # Name the defect precisely when it is in the logits; else the op's own words, located in
        # the file (its chunk-relative row made absolute), with the command line's advice.
        check_finite(d, logits, a)
        err = errors.from_op_error(exc, keys=PARAM_KEYS + ("sampled",), default_key="logits")
        hint = "use --outside flag to record such rows" if isinstance(exc, OutsideSupportError) else err.hint
        raise err.at(file=d.path, row_offset=a, hint=hint, cls=DumpError) from exc
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
        extras["logprob_mismatch"] = (
            check_rows(logits, sampled, params["temperature"], extras["logprobs"], m.logprobs, tol) if has_lp
            else torch.full((b - a,), -1, dtype=torch.int8))
    return m, extras
