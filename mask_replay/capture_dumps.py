"""Capture over rollout dump files: stream rows in chunks through mask_replay.capture, write one mask file.

Memory is bounded by one chunk, whatever the support widths: logits are read chunk by chunk (pread,
see dumps.py), and each chunk's mask goes straight into the output file (safetensors_io.StreamWriter:
per-row keys at their place, `token_ids` appended, the header written last). What stays in memory
for the whole run is 9 bytes per row (support sizes for the summary, the outside-support flags).
The file is built under a temp name and renamed onto the output only when complete.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from mask_replay.dumps import PARAM_KEYS, Dump, check_finite, check_sampled, shift_row
import contextlib

from mask_replay import profiles
from mask_replay.io import DumpError, atomic_file, check_distinct, check_writable
from mask_replay.profiles.mismatch import DEFAULT_TOLERANCE, check_rows
from mask_replay.profiles.mismatch import summarise as mismatch_summary
from mask_replay.safetensors_io import StreamWriter

# Target bytes per chunk when --chunk-rows is not given: the chunk's logits plus the widest mask they
# can give (every token kept: 4 bytes of int32 id each), so that flat rows at top-p .95 stay within
# budget too (measured: 0.66 GB peak anonymous memory for 6 and 12 GB dumps, benchmarks/bench_memory.py).
DEFAULT_CHUNK_BYTES = 256 << 20
MASK_ENTRY_BYTES = 4
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
    return max(1, DEFAULT_CHUNK_BYTES // max(1, vocab * (element_size + MASK_ENTRY_BYTES)))


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
    out = os.fspath(out) if out is not None else None
    if not paths:
        raise DumpError("capture: no input files given")
    profiles.check_profile(profile)
    if out is not None:
        check_distinct([("dump", p) for p in paths], [("the output", out)])
        check_writable(out)  # fail before the long part, not after it
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}

    dumps = []
    try:
        for p in paths:
            dumps.append(Dump(p))
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
        metadata = {
            "vocab_size": vocab,
            "sources": [os.path.basename(d.path) for d in dumps],
            "params": {os.path.basename(d.path): {k: _param_source(d, k, flags, explicit) for k in PARAM_KEYS}
                       for d in dumps},
            "logprobs_source": {os.path.basename(d.path): "rollout_logprobs" if h else "computed"
                                for d, h in zip(dumps, engine_lp)},
            "outside": outside,
            "semantics": profiles.semantics(profile),
        }

        from tqdm import tqdm

        compare = any(engine_lp)
        lo_row, hi_row = (0, total) if rows is None else (max(0, rows[0]), min(total, rows[1]))
        count = max(0, hi_row - lo_row)
        bytes_read, t0 = 0, time.perf_counter()
        lengths = torch.empty(count, dtype=torch.int64)
        flagged = torch.zeros(count, dtype=torch.bool)
        # O(rows) per-row values for the log-prob mismatch report (never O(nnz))
        codes = torch.full((count,), -1, dtype=torch.int8)
        engine_lps, capture_lps = torch.zeros(count), torch.zeros(count)
        with (atomic_file(out) if out is not None else contextlib.nullcontext()) as f:
            sink = MaskSink(f, count, vocab, carried, outside, metadata, compare) if out is not None \
                else MemorySink(carried, outside, metadata, compare)
            # closed (and cleared) on errors too, so an error line never lands after a half-drawn bar
            with tqdm(total=count, unit="rows", desc="capture", disable=not progress or None, leave=False) as bar:
                row, first = 0, 0  # row: written so far; first: global row of the file's row 0
                for d, (n, _), has_lp in zip(dumps, shapes, engine_lp):
                    lo, hi = max(0, lo_row - first), min(n, hi_row - first)
                    first += n
                    step = chunk_rows or max(1, default_chunk_rows(vocab, torch.empty(0, dtype=d.dtype("logits")).element_size())
                                             // profiles.CHUNK_DIVISOR[profile])
                    for a in range(lo, hi, step):
                        b = min(hi, a + step)
                        m, extras = _capture_chunk(d, a, b, flags, explicit, device, outside, has_lp, carried,
                                                   profile, logprob_tolerance, compare)
                        sink.write(row, m, extras)
                        lengths[row: row + b - a] = m.lengths()
                        flagged[row: row + b - a] = extras["outside_support"]
                        if compare:
                            codes[row: row + b - a] = extras["logprob_mismatch"]
                            engine_lps[row: row + b - a] = extras["logprobs"]
                            capture_lps[row: row + b - a] = extras["capture_logprobs"]
                        row += b - a
                        bytes_read += d.nbytes("logits") * (b - a) // max(n, 1)
                        bar.update(b - a)
            mismatch = mismatch_summary(codes, engine_lps, capture_lps, logprob_tolerance) if compare else None
            mask = sink.finish(flagged, codes if compare else None, mismatch)
            bytes_written = 0
            if f is not None:
                f.seek(0, os.SEEK_END)
                bytes_written = f.tell()
        seconds = time.perf_counter() - t0
    finally:
        for d in dumps:
            d.close()
    return CaptureSummary(count, int(lengths.sum()), vocab, lengths, bytes_read, bytes_written, seconds,
                          int(flagged.sum()), notes, mask, mismatch)


# Room kept in a streamed mask file's header for the log-prob mismatch report, which is known only
# at the end (a few counts and a cause name: well under this).
MISMATCH_REPORT_ROOM = 1024


class MaskSink:
    """A mask file written chunk by chunk (layout in safetensors_io.StreamWriter)."""

    def __init__(self, f, rows: int, vocab: int, carried, outside: str, metadata: dict, compare: bool = False):
        from mask_replay.mask import file_metadata

        head = {"offsets": (torch.int64, (rows + 1,))}
        for k in ("sampled",) + tuple(carried):
            head[k] = (torch.int64, (rows,))
        for k in ("logprobs", "kept_mass", "capture_logprobs", "temperature"):
            head[k] = (torch.float32, (rows,))
        # one-byte tensors go after token_ids (alignment): outside_support only when some row was
        # flagged, logprob_mismatch when some dump had rollout_logprobs
        tail = {"outside_support": (torch.bool, (rows,))} if outside == "flag" else {}
        if compare:
            tail["logprob_mismatch"] = (torch.int8, (rows,))
        self.outside = outside
        self.nnz = 0
        self.w = StreamWriter(f, head, growing=("token_ids", torch.int32, rows * vocab), tail_room=tail,
                              metadata=file_metadata(metadata),
                              metadata_room=MISMATCH_REPORT_ROOM if compare else 0)
        self.w.write_rows("offsets", 0, torch.zeros(1, dtype=torch.int64))

    def write(self, row0: int, m, extras: dict) -> None:
        """Rows [row0, row0 + m.num_rows): the chunk's mask and its per-row keys."""
        self.w.write_rows("offsets", row0 + 1, m.offsets[1:].cpu() + self.nnz)
        self.w.append(m.token_ids)
        self.nnz += m.nnz
        self.w.write_rows("sampled", row0, m.sampled)
        self.w.write_rows("kept_mass", row0, m.kept_mass)
        for k, v in extras.items():
            if k not in ("outside_support", "logprob_mismatch"):
                self.w.write_rows(k, row0, v)

    def finish(self, flagged: torch.Tensor, codes: Optional[torch.Tensor], mismatch: Optional[dict]):
        tail = {"outside_support": flagged} if self.outside == "flag" and bool(flagged.any()) else {}
        if codes is not None:
            tail["logprob_mismatch"] = codes
        self.w.finish(tail, metadata={"logprob_mismatch": _json(mismatch)} if mismatch is not None else None)
        return None  # the mask is on disk, never whole in memory


class MemorySink:
    """One rank's share under torchrun (mask_replay.distributed): the chunks' masks kept in memory
    and concatenated, for rank 0 to gather and write."""

    def __init__(self, carried, outside: str, metadata: dict, compare: bool = False):
        self.carried, self.outside, self.metadata, self.parts = carried, outside, metadata, []
        self.compare = compare

    def write(self, row0: int, m, extras: dict) -> None:
        self.parts.append((m, extras))

    def finish(self, flagged, codes, mismatch):
        mask = _concat(self.parts, self.carried, self.outside, self.compare)
        mask.metadata = dict(self.metadata)
        if mismatch is not None:
            mask.metadata["logprob_mismatch"] = mismatch
        return mask


def _json(value) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _concat(parts, carried, outside, compare=False):
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
        if compare:  # MaskSink writes this column whenever some dump has rollout_logprobs, rows or not
            mask.extras["logprob_mismatch"] = torch.zeros(0, dtype=torch.int8)
    if outside == "error" or not bool(mask.extras.get("outside_support", torch.zeros(0, dtype=torch.bool)).any()):
        mask.extras.pop("outside_support", None)  # only written when some row was flagged
    return mask


def _capture_chunk(d: Dump, a, b, flags, explicit, device, outside, has_lp, carried, profile, tol, compare):
    import mask_replay

    logits = d.get("logits", a, b, stream=True)  # released when the next chunk is read
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
        message = shift_row(str(exc), a).replace("pass outside='flag'", "use --outside flag")
        raise DumpError(f"{d.path}: key '{_key_of(str(exc))}': {message}") from exc
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
