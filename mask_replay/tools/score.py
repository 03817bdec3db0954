"""Score: how far training log-probs are from the rollout's, with replay (over the recorded support)
and without (over the full vocabulary). Reads a mask file and a training dump row-aligned with it,
in row chunks, so memory does not grow with either file."""
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
from mask_replay.files.mask_file import MaskFile
from mask_replay.trainer.metrics import build_report, support_kl_per_row
from mask_replay.trainer.replay import full_logprobs, kept_mass, replay_logprobs
from mask_replay.trainer.support_logprobs import replay_support_logprobs


@dataclass
class ScoreResult:
    report: dict  # JSON: tokens, kept_mass_mean, replay, no_replay, per_step
    rollout: np.ndarray  # per token, float64
    replay: np.ndarray
    no_replay: np.ndarray
    step: Optional[np.ndarray]
    notes: list = field(default_factory=list)


@dataclass
class _Rows:
    """What the mask file says of each row before any logits are read."""

    temperature: torch.Tensor  # float32 [N], greedy rows set to 1 (run through the ops, never scored)
    greedy: torch.Tensor  # bool [N]
    skipped: torch.Tensor  # bool [N]: flagged by capture, or an empty support
    flagged: torch.Tensor
    unsampled: torch.Tensor
    kept: torch.Tensor  # float32 [N], the file's kept mass (zeros until computed when it has none)


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
    log-probs. Errors are DumpError naming the file, key and row. rows=(a, b) computes only the
    log-probs of rows [a, b); combine(replay[a:b], no_replay[a:b], kept[a:b]) then returns the arrays
    of all rows, or None to stop here (ranks other than 0 under torchrun, see tools/torchrun.py)."""
    masks_path, training_path = os.fspath(masks_path), os.fspath(training_path)
    inputs = score_inputs(masks_path, training_path)  # before reading: what this report is made from
    notes = []
    with MaskFile(masks_path) as mask, Dump(training_path) as tr:
        info = _row_info(mask, tr, masks_path, notes)
        first, last = rows if rows is not None else (0, mask.num_rows)
        rep, full, kl = _log_probs(mask, tr, info, masks_path, first, last, chunk_rows, device, progress)
    kept = info.kept
    if combine is not None:
        arrays = (rep[first:last], full[first:last], kept[first:last]) + (() if kl is None else (kl[first:last],))
        combined = combine(*arrays)
        if combined is None:
            return None
        rep, full, kept, *rest = combined
        kl = rest[0] if rest else None
    result = _result(mask, info, rep, full, kept, notes, kl)
    result.report["inputs"] = inputs
    return result


def score_inputs(masks_path, training_path) -> dict:
    """The report's `inputs`: the content identity of the two files it was made from (files/identity.py),
    which `score --resume` compares before it keeps a report."""
    return {"masks": file_identity(masks_path), "training": file_identity(training_path)}


def _row_info(mask: MaskFile, tr: Dump, masks_path: str, notes: list) -> _Rows:
    for key in ("sampled", "logprobs"):
        if getattr(mask, key) is None:
            raise DumpError("missing (write mask files with `mask-replay capture`)", file=masks_path, key=key)
    n = mask.num_rows
    temp = mask.extras.get("temperature")
    if temp is None:
        notes.append(f"{masks_path}: no 'temperature' key: scoring at temperature 1.0")
        temp = torch.ones(n)
    temp = temp.to(torch.float32)
    bad = torch.nonzero(~torch.isfinite(temp) | (temp < 0)).flatten()
    if bad.numel():
        r = int(bad[0])
        raise DumpError(f"{float(temp[r])} is not a finite value >= 0 at row {{row}}", file=masks_path,
                        key="temperature", row=r)
    # Greedy rows (T = 0) have no sampling distribution to compare: they are left out of the
    # metrics, and run through the ops at T = 1 only so that nothing divides by zero.
    greedy = temp == 0
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    nt, vocab = tr.require_logits()
    if nt != n:
        raise tr.err("logits", f"{nt} rows but the mask file {masks_path} has {n} rows")
    mv = _metadata_int(mask.metadata, "vocab_size", masks_path)
    if mv is not None and mv != vocab:
        raise tr.err("logits", f"vocab size {vocab} does not match the mask file's {mv} ({masks_path})")
    flagged = mask.extras.get("outside_support", torch.zeros(n, dtype=torch.bool)).bool()
    # an engine mask may hold unsampled rows (empty support, e.g. forced tokens): nothing to
    # replay there, so they are left out like flagged rows
    unsampled = (mask.offsets[1:] - mask.offsets[:-1]).cpu() == 0
    kept = mask.kept_mass
    if kept is None:
        notes.append("no 'kept_mass' in the mask file: kept_mass_mean is computed on the training logits")
        kept = torch.zeros(n)
    return _Rows(temp, greedy, flagged | unsampled, flagged, unsampled, kept.clone())


def _log_probs(mask, tr, info: _Rows, masks_path, first, last, chunk_rows, device, progress):
    """(replay, no replay) float32 [N], filled for rows [first, last), chunk by chunk, and when the mask
    file has entry_logprobs the support KL(rollout || training) per row (float64 [N], else None)."""
    n, vocab = mask.num_rows, tr.shape("logits")[1]
    step_rows = chunk_rows or default_chunk_rows(vocab, tr.dtype("logits").itemsize)
    rep = torch.empty(n, dtype=torch.float32)
    full = torch.empty(n, dtype=torch.float32)
    kl = torch.zeros(n, dtype=torch.float64) if mask.has_entry_logprobs else None
    with tqdm(total=last - first, unit="rows", desc="score", disable=not progress or None, leave=False) as bar, \
            torch.no_grad():
        for a in range(first, last, step_rows):
            b = min(last, a + step_rows)
            logits = tr.get("logits", a, b, stream=True)  # released when the next chunk is read
            sub = mask.rows(a, b, vocab)
            sampled, t = sub.sampled, info.temperature[a:b]
            if device != "cpu":
                logits, sub, sampled, t = logits.to(device), sub.to(device), sampled.to(device), t.to(device)
            full[a:b] = _full(tr, logits, sampled, t, a).cpu()
            rep[a:b] = _replay(logits, sub, sampled, t, info.skipped[a:b], masks_path, a).cpu()
            if mask.kept_mass is None:
                info.kept[a:b] = kept_mass(logits, sub, t).cpu()
            if kl is not None:
                kl[a:b] = _support_kl(logits, sub, t, masks_path, a).cpu()
            bar.update(b - a)
    return rep, full, kl


def _support_kl(logits, sub, t, masks_path, row0):
    try:
        lp = replay_support_logprobs(logits, sub, temperature=t)
    except (RuntimeError, ValueError) as exc:
        err = errors.from_op_error(exc, default_key="token_ids")
        raise err.at(file=masks_path, row_offset=row0, cls=DumpError) from exc
    return support_kl_per_row(sub.entry_logprobs, lp, sub.row_ids(), sub.num_rows)


def _result(mask, info: _Rows, rep, full, kept, notes, kl=None) -> ScoreResult:
    """Rows that cannot be scored are left out (each kind named in a note); the report of the rest."""
    rollout = mask.logprobs.double().numpy()
    greedy, flagged, unsampled = info.greedy.numpy(), info.flagged.numpy(), info.unsampled.numpy()
    skip = flagged | unsampled
    no_train = ~np.isfinite(full.numpy()) & ~skip  # a -inf training logit at the sampled token
    no_rollout = ~np.isfinite(rollout) & ~skip
    keep = ~(greedy | skip | no_train | no_rollout)
    if greedy.any():
        n_greedy = int(greedy.sum())
        notes.append(f"{n_greedy} greedy {'row' if n_greedy == 1 else 'rows'} (temperature 0) left out of the metrics")
    left_out = ((flagged, "flagged by capture (--outside flag: sampled token outside the support)"),
                (unsampled, "with an empty support (not sampled by the engine)"),
                (no_rollout, "without a finite rollout log-prob"),
                (no_train, "with a -inf training log-prob (the training logit of the sampled token is -inf)"))
    for which, what in left_out:
        if which.any():
            notes.append(f"{_plural_rows(int(which.sum()))} {what}, first row {int(np.argmax(which))}: "
                         "left out of the metrics")

    def pick(x):
        return None if x is None else x.numpy()[keep]

    step, seq = pick(mask.extras.get("step")), pick(mask.extras.get("sequence"))
    rollout, r, f = rollout[keep], rep.double().numpy()[keep], full.double().numpy()[keep]
    support_kl = None if kl is None else kl.double().numpy()[keep]
    report = build_report(rollout, r, f, kept.double().numpy()[keep], step, seq, support_kl)
    return ScoreResult(report, rollout, r, f, step, notes)


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
