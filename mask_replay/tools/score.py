"""Score: how far training log-probs are from the rollout's, with replay (over the recorded support)
and without (over the full vocabulary). Reads a mask file and a training dump row-aligned with it,
in row chunks, and sums each chunk into the report (tools/score_stats.py), so score's own memory
does not grow with either file."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from mask_replay import errors
from mask_replay.errors import DumpError
from mask_replay.files.dumps import Dump, check_finite, default_chunk_rows
from mask_replay.files.identity import file_identity
from mask_replay.files.mask_file import MaskFile, RowKey
from mask_replay.tools.score_stats import ReportStream
from mask_replay.trainer.metrics import support_kl_per_row
from mask_replay.trainer.replay import full_logprobs, kept_mass, replay_logprobs
from mask_replay.trainer.support_logprobs import replay_support_logprobs


@dataclass
class ScoreResult:
    report: dict  # JSON: tokens, kept_mass_mean, replay, no_replay, per_step (support, sequences)
    notes: list = field(default_factory=list)


@dataclass
class _Rows:
    """What the mask file says of every row (its per-row keys, read a chunk at a time)."""

    temperature: Optional[RowKey]  # [N], None: every row at 1.0
    outside: Optional[RowKey]  # bool [N], rows flagged by capture (--outside flag), or None
    vocab: int  # the training logits'


def report_json(report: dict) -> str:
    """The report as strict JSON (RFC 8259 has no NaN or Infinity): a metric that is not a finite
    number (no tokens to average, an overflowing ratio) is written as null."""

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, float) and not np.isfinite(x):
            return None
        return x

    return json.dumps(clean(report), indent=2, allow_nan=False) + "\n"


def _plural_rows(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def score_files(masks_path, training_path, *, chunk_rows: Optional[int] = None, device: str = "cpu",
                progress: bool = True, rows: Optional[tuple] = None, combine=None) -> Optional[ScoreResult]:
    """Training log-probs with and without replay for every row, against the mask file's rollout
    log-probs, summed chunk by chunk into the report (tools/score_stats.py): no per-row array is
    kept, so score's memory does not grow with the rows. Errors are DumpError naming the file, key
    and row. rows=(a, b) scores only rows [a, b); with combine, the log-probs of rows [a, b) are kept
    and combine(replay, no_replay, kept[, support_kl]) returns those of all rows, or None to stop
    here (ranks other than 0 under torchrun, see tools/torchrun.py)."""
    masks_path, training_path = os.fspath(masks_path), os.fspath(training_path)
    inputs = score_inputs(masks_path, training_path)  # before reading: what this report is made from
    notes = []
    with MaskFile(masks_path) as mask, Dump(training_path) as tr:
        info = _row_info(mask, tr, masks_path, notes)
        first, last = rows if rows is not None else (0, mask.num_rows)
        step_rows = chunk_rows or default_chunk_rows(info.vocab, tr.dtype("logits").itemsize)
        chunks = _chunk_log_probs(mask, tr, info, masks_path, first, last, step_rows, device, progress)
        if combine is not None:
            chunks = _combined(chunks, combine, mask.has_entry_logprobs, step_rows)
        tally = _Tally()
        with ReportStream("step" in mask.extras, "sequence" in mask.extras, mask.has_entry_logprobs) as stream:
            for a, rep, full, kept, kl in chunks:
                if rep is None:  # under torchrun, a rank other than 0
                    return None
                _add_rows(stream, tally, mask, info, a, rep, full, kept, kl)
            report = stream.report()
    report["inputs"] = inputs
    return ScoreResult(report, notes + tally.notes())


def score_inputs(masks_path, training_path) -> dict:
    """The report's `inputs`: the content identity of the two files it was made from (files/identity.py),
    which `score --resume` compares before it keeps a report."""
    return {"masks": file_identity(masks_path), "training": file_identity(training_path)}


def _row_info(mask: MaskFile, tr: Dump, masks_path: str, notes: list) -> _Rows:
    """The whole-file checks, before any logits are read (block by block: no per-row copies)."""
    for key in ("sampled", "logprobs"):
        if getattr(mask, key) is None:
            raise DumpError("missing (write mask files with `mask-replay capture`)", file=masks_path, key=key)
    n = mask.num_rows
    temp = mask.extras.get("temperature")
    if temp is None:
        notes.append(f"{masks_path}: no 'temperature' key: scoring at temperature 1.0")
    else:
        for a, t in temp.blocks():
            t = t.to(torch.float32)
            bad = torch.nonzero(~torch.isfinite(t) | (t < 0)).flatten()
            if bad.numel():
                r = int(bad[0])
                raise DumpError(f"{float(t[r])} is not a finite value >= 0 at row {{row}}", file=masks_path,
                                key="temperature", row=a + r)
    nt, vocab = tr.require_logits()
    if nt != n:
        raise tr.err("logits", f"{nt} rows but the mask file {masks_path} has {n} rows")
    mv = _metadata_int(mask.metadata, "vocab_size", masks_path)
    if mv is not None and mv != vocab:
        raise tr.err("logits", f"vocab size {vocab} does not match the mask file's {mv} ({masks_path})")
    if mask.kept_mass is None:
        notes.append("no 'kept_mass' in the mask file: kept_mass_mean is computed on the training logits")
    return _Rows(temp, mask.extras.get("outside_support"), vocab)


def _flags(mask: MaskFile, info: _Rows, a: int, b: int):
    """(temperature, greedy, flagged, unsampled) of rows [a, b). Greedy rows (T = 0) have no sampling
    distribution to compare: they are left out of the metrics, and run through the ops at T = 1 only
    so that nothing divides by zero."""
    temp = torch.ones(b - a) if info.temperature is None else info.temperature[a:b].to(torch.float32)
    greedy = temp == 0
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    flagged = torch.zeros(b - a, dtype=torch.bool) if info.outside is None else info.outside[a:b].bool()
    # an engine mask may hold unsampled rows (empty support, e.g. forced tokens): nothing to
    # replay there, so they are left out like flagged rows
    o = mask.offsets[a: b + 1]
    unsampled = (o[1:] - o[:-1]) == 0
    return temp, greedy, flagged, unsampled


def _chunk_log_probs(mask, tr, info: _Rows, masks_path, first, last, step_rows, device, progress):
    """Yields (row0, replay, no replay, kept mass, support KL or None) of each chunk of rows
    [first, last): float32 log-probs, the file's kept mass (the training logits' when the file has
    none) and, when the mask file has entry_logprobs, the support KL(rollout || training) per row
    (float64)."""
    with tqdm(total=last - first, unit="rows", desc="score", disable=not progress or None, leave=False) as bar, \
            torch.no_grad():
        for a in range(first, last, step_rows):
            b = min(last, a + step_rows)
            logits = tr.get("logits", a, b, stream=True)  # released when the next chunk is read
            sub = mask.rows(a, b, info.vocab)
            sampled = sub.sampled
            t, _, flagged, unsampled = _flags(mask, info, a, b)
            if device != "cpu":
                logits, sub, sampled, t = logits.to(device), sub.to(device), sampled.to(device), t.to(device)
            full = _full(tr, logits, sampled, t, a).cpu()
            rep = _replay(logits, sub, sampled, t, flagged | unsampled, masks_path, a).cpu()
            kept = mask.kept_mass[a:b] if mask.kept_mass is not None else kept_mass(logits, sub, t).cpu()
            kl = _support_kl(logits, sub, t, masks_path, a).cpu() if mask.has_entry_logprobs else None
            yield a, rep, full, kept, kl
            bar.update(b - a)


def _combined(chunks, combine, has_kl: bool, step_rows: int):
    """Under torchrun: this rank's chunks joined, combine() of them (every rank's rows in row order on
    rank 0), then those rows again in chunks; a single (0, None, ...) on the other ranks. These
    arrays are per row: the ranks exchange them (tools/torchrun.py)."""
    parts = list(chunks)
    cols = [torch.cat([p[i] for p in parts]) if parts else torch.zeros(0) for i in (1, 2, 3)]
    if has_kl:
        cols.append(torch.cat([p[4] for p in parts]) if parts else torch.zeros(0, dtype=torch.float64))
    del parts
    combined = combine(*cols)
    if combined is None:
        yield 0, None, None, None, None
        return
    rep, full, kept, *rest = combined
    kl = rest[0] if rest else None
    for a in range(0, rep.numel(), step_rows):
        b = a + step_rows
        yield a, rep[a:b], full[a:b], kept[a:b], None if kl is None else kl[a:b]


def _support_kl(logits, sub, t, masks_path, row0):
    try:
        lp = replay_support_logprobs(logits, sub, temperature=t)
    except (RuntimeError, ValueError) as exc:
        err = errors.from_op_error(exc, default_key="token_ids")
        raise err.at(file=masks_path, row_offset=row0, cls=DumpError) from exc
    return support_kl_per_row(sub.entry_logprobs, lp, sub.row_ids(), sub.num_rows)


class _Tally:
    """Rows left out of the metrics, by kind: how many, and the first."""

    KINDS = (("greedy", None),
             ("flagged", "flagged by capture (--outside flag: sampled token outside the support)"),
             ("unsampled", "with an empty support (not sampled by the engine)"),
             ("no_rollout", "without a finite rollout log-prob"),
             ("no_train", "with a -inf training log-prob (the training logit of the sampled token is -inf)"))

    def __init__(self):
        self.count = {k: 0 for k, _ in self.KINDS}
        self.first = {}

    def add(self, kind: str, which: np.ndarray, row0: int) -> None:
        c = int(np.count_nonzero(which))
        if c:
            self.count[kind] += c
            self.first.setdefault(kind, row0 + int(np.argmax(which)))

    def notes(self) -> list:
        out = []
        g = self.count["greedy"]
        if g:
            out.append(f"{g} greedy {'row' if g == 1 else 'rows'} (temperature 0) left out of the metrics")
        for kind, what in self.KINDS[1:]:
            if self.count[kind]:
                out.append(f"{_plural_rows(self.count[kind])} {what}, first row {self.first[kind]}: "
                           "left out of the metrics")
        return out


def _add_rows(stream: ReportStream, tally: _Tally, mask, info: _Rows, a, rep, full, kept, kl) -> None:
    """Rows [a, a + len(rep)) into the report. Rows that cannot be scored are left out, each kind
    counted for a note."""
    b = a + rep.numel()
    _, greedy, flagged, unsampled = (x.numpy() for x in _flags(mask, info, a, b))
    rollout = mask.logprobs[a:b].double().numpy()
    full = full.double().numpy()
    skip = flagged | unsampled
    no_train = ~np.isfinite(full) & ~skip  # a -inf training logit at the sampled token
    no_rollout = ~np.isfinite(rollout) & ~skip
    keep = ~(greedy | skip | no_train | no_rollout)
    for kind, which in (("greedy", greedy), ("flagged", flagged), ("unsampled", unsampled),
                        ("no_rollout", no_rollout), ("no_train", no_train)):
        tally.add(kind, which, a)

    def pick(key):
        x = mask.extras.get(key)
        return None if x is None else x[a:b].numpy().astype(np.int64)[keep]

    stream.add(rollout[keep], rep.double().numpy()[keep], full[keep], kept.double().numpy()[keep],
               pick("step"), pick("sequence"), None if kl is None else kl.double().numpy()[keep])


def _metadata_int(meta: dict, key: str, path: str):
    v = meta.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise DumpError(f"metadata '{key}': not an integer ({v!r})", file=path) from None


def _full(tr, logits, sampled, t, row0):
    """Full-vocabulary log-probs; the pass over the logits doubles as the NaN/+inf check: a bad row
    makes its log-sum-exp non-finite, and only such rows are examined (and named)."""
    try:
        logp = full_logprobs(logits, sampled, t)
    except RuntimeError:
        check_finite(tr, logits.cpu(), row0)
        raise
    for r in torch.nonzero(~torch.isfinite(logp)).flatten().tolist():
        check_finite(tr, logits[r: r + 1].cpu(), row0 + r)
    return logp


def _replay(logits, sub, sampled, t, skipped, masks_path, row0):
    try:
        if bool(skipped.any()):
            # rows capture flagged as outside their support are left out of the metrics; let the op
            # fall back there, but a fallback on any other row is still a broken mask file
            logp, status = replay_logprobs(logits, sub, sampled, t, fallback=True, return_status=True)
            bad = torch.nonzero((status.cpu() != 0) & ~skipped)
            if bad.numel():
                r = int(bad[0])
                raise DumpError(f"token {int(sampled[r])} is outside the recorded support of row {{row}}",
                                file=masks_path, key="sampled", row=row0 + r)
            return logp
        return replay_logprobs(logits, sub, sampled, t)
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, DumpError):
            raise
        # the op's advice (fallback=True) is for Python callers; on the command line the fix is the file
        err = errors.from_op_error(exc, default_key="sampled")
        raise err.at(file=masks_path, key="sampled", row_offset=row0, cls=DumpError,
                     hint="capture with --outside flag records such rows") from exc
