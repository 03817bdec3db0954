"""Score: how far training log-probs are from the rollout's, with replay (over the recorded support)
and without (over the full vocabulary). Reads a mask file and a training dump row-aligned with it."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from mask_replay.dumps import Dump, check_finite, shift_row
from mask_replay.io import DumpError

METRICS = ("importance_ratio_mean", "importance_ratio_median", "logp_diff_mean", "logp_diff_std",
           "kl_k1", "kl_k3", "chi2", "frac_outside_0.9_1.1")
DEFAULT_CHUNK_BYTES = 256 << 20


def ratio_metrics(diff: np.ndarray) -> dict:
    """Metrics of d = training - rollout log-prob per token, with r = exp(d) the importance ratio.
    k1 = E[-d] and k3 = E[r - 1 - d] estimate KL(rollout || training) from rollout samples."""
    d = np.asarray(diff, dtype=np.float64)
    if d.size == 0:
        return {k: float("nan") for k in METRICS}
    with np.errstate(all="ignore"):  # an overflowing ratio is reported as such (null), not warned about
        return _ratio_metrics(d)


def _ratio_metrics(d):
    r = np.exp(d)
    return {
        "importance_ratio_mean": float(r.mean()),
        "importance_ratio_median": float(np.median(r)),
        "logp_diff_mean": float(d.mean()),
        "logp_diff_std": float(d.std()),
        "kl_k1": float(-d.mean()),
        "kl_k3": float((r - 1.0 - d).mean()),
        "chi2": float((r * r).mean() - 1.0),
        "frac_outside_0.9_1.1": float(((r < 0.9) | (r > 1.1)).mean()),
    }


def sequence_metrics(diff: np.ndarray, seq_keys: np.ndarray) -> dict:
    """Sequence-level ratios: r_seq = exp(sum of d over the sequence's tokens)."""
    _, inv = np.unique(seq_keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    log_r = np.bincount(inv, weights=diff)
    with np.errstate(all="ignore"):
        r = np.exp(log_r)
        return {
            "sequences": int(log_r.size),
            "sequence_ratio_mean": float(r.mean()),
            "sequence_ratio_median": float(np.median(r)),
            "sequence_ratio_std": float(r.std()),
            "sequence_log_ratio_mean": float(log_r.mean()),
            "sequence_log_ratio_std": float(log_r.std()),
        }


def report_json(report: dict) -> str:
    """The report as strict JSON (RFC 8259 has no NaN or Infinity): a metric that is not a finite
    number (no tokens to average, an overflowing ratio) is written as null."""
    import json

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, float) and not np.isfinite(x):
            return None
        return x

    return json.dumps(clean(report), indent=2, allow_nan=False) + "\n"


def _rows(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


@dataclass
class ScoreResult:
    report: dict  # JSON: tokens, kept_mass_mean, replay, no_replay, per_step
    rollout: np.ndarray  # per token, float64
    replay: np.ndarray
    no_replay: np.ndarray
    step: Optional[np.ndarray]
    notes: list = field(default_factory=list)


def build_report(rollout, replay, no_replay, kept, step=None, sequence=None) -> dict:
    d_rep, d_full = replay - rollout, no_replay - rollout
    report = {
        "tokens": int(rollout.size),
        "kept_mass_mean": float(np.mean(kept)) if kept.size else float("nan"),
        "replay": ratio_metrics(d_rep),
        "no_replay": ratio_metrics(d_full),
        "per_step": {},
    }
    if sequence is not None and rollout.size:
        # the same sequence index may recur at another step: a sequence is (step, sequence)
        keys = np.stack([step if step is not None else np.zeros_like(sequence), sequence], axis=1)
        report["replay"].update(sequence_metrics(d_rep, keys))
        report["no_replay"].update(sequence_metrics(d_full, keys))
    if step is not None:
        for s in np.unique(step):
            sel = step == s
            report["per_step"][str(int(s))] = {
                "tokens": int(sel.sum()),
                "kept_mass_mean": float(kept[sel].mean()),
                "replay": ratio_metrics(d_rep[sel]),
                "no_replay": ratio_metrics(d_full[sel]),
            }
    return report


def score_files(masks_path, training_path, *, chunk_rows: Optional[int] = None, device: str = "cpu",
                progress: bool = True, rows: Optional[tuple] = None, combine=None) -> Optional[ScoreResult]:
    """Training log-probs with and without replay for every row, against the mask file's rollout
    log-probs. Errors are DumpError naming the file, key and row. rows=(a, b) computes only the
    log-probs of rows [a, b); combine(replay[a:b], no_replay[a:b], kept[a:b]) then returns the arrays
    of all rows, or None to stop here (ranks other than 0 under torchrun, see mask_replay.distributed)."""
    import mask_replay  # ops looked up at call time
    from mask_replay.mask_file import MaskFile

    masks_path, training_path = os.fspath(masks_path), os.fspath(training_path)
    with MaskFile(masks_path) as mask, Dump(training_path) as tr:
        for key in ("sampled", "logprobs"):
            if getattr(mask, key) is None:
                raise DumpError(f"{masks_path}: key '{key}': missing (write mask files with `mask-replay capture`)")
        notes = []
        n = mask.num_rows
        temp = mask.extras.get("temperature")
        if temp is None:
            notes.append(f"{masks_path}: no 'temperature' key: scoring at temperature 1.0")
            temp = torch.ones(n)
        temp = temp.to(torch.float32)
        bad = torch.nonzero(~torch.isfinite(temp) | (temp < 0)).flatten()
        if bad.numel():
            r = int(bad[0])
            raise DumpError(f"{masks_path}: key 'temperature': {float(temp[r])} is not a finite value >= 0 at row {r}")
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

        from tqdm import tqdm

        step_rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (vocab * torch.empty(0, dtype=tr.dtype("logits")).element_size()))
        rep = torch.empty(n, dtype=torch.float32)
        full = torch.empty(n, dtype=torch.float32)
        with tqdm(total=n, unit="rows", desc="score", disable=not progress or None, leave=False) as bar, \
                torch.no_grad():
            first, last = rows if rows is not None else (0, n)
            for a in range(first, last, step_rows):
                b = min(last, a + step_rows)
                logits = tr.get("logits", a, b, stream=True)  # released when the next chunk is read
                sub = mask.rows(a, b, vocab)
                sampled, t = sub.sampled, temp[a:b]
                if device != "cpu":
                    logits, sub, sampled, t = logits.to(device), sub.to(device), sampled.to(device), t.to(device)
                full[a:b] = _full(mask_replay, tr, logits, sampled, t, a).cpu()
                rep[a:b] = _replay(mask_replay, logits, sub, sampled, t, flagged[a:b] | unsampled[a:b], masks_path, a).cpu()
                if mask.kept_mass is None:
                    kept[a:b] = mask_replay.kept_mass(logits, sub, t).cpu()
                bar.update(b - a)

    if combine is not None:
        combined = combine(rep[first:last], full[first:last], kept[first:last])
        if combined is None:
            return None
        rep, full, kept = combined
    rollout = mask.logprobs.double().numpy()
    greedy_np, flagged_np, unsampled_np = greedy.numpy(), flagged.numpy(), unsampled.numpy()
    skip = flagged_np | unsampled_np
    no_train = ~np.isfinite(full.numpy()) & ~skip  # a -inf training logit at the sampled token
    no_rollout = ~np.isfinite(rollout) & ~skip
    keep = ~(greedy_np | skip | no_train | no_rollout)
    if greedy_np.any():
        n_greedy = int(greedy_np.sum())
        notes.append(f"{n_greedy} greedy {'row' if n_greedy == 1 else 'rows'} (temperature 0) left out of the metrics")
    left_out = ((flagged_np, "flagged by capture (--outside flag: sampled token outside the support)"),
                (unsampled_np, "with an empty support (not sampled by the engine)"),
                (no_rollout, "without a finite rollout log-prob"),
                (no_train, "with a -inf training log-prob (the training logit of the sampled token is -inf)"))
    for which, what in left_out:
        if which.any():
            notes.append(f"{_rows(int(which.sum()))} {what}, first row {int(np.argmax(which))}: left out of the metrics")
    pick = lambda x: None if x is None else x.numpy()[keep]  # noqa: E731
    step, seq = pick(mask.extras.get("step")), pick(mask.extras.get("sequence"))
    rollout, r, f = rollout[keep], rep.double().numpy()[keep], full.double().numpy()[keep]
    report = build_report(rollout, r, f, kept.double().numpy()[keep], step, seq)
    return ScoreResult(report, rollout, r, f, step, notes)


def _metadata_int(meta: dict, key: str, path: str):
    v = meta.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise DumpError(f"{path}: metadata '{key}': not an integer ({v!r})") from None


def _full(mask_replay, tr, logits, sampled, t, row0):
    """Full-vocabulary log-probs; the pass over the logits doubles as the NaN/+inf check: a bad row
    makes its log-sum-exp non-finite, and only such rows are examined (and named)."""
    try:
        logp = mask_replay.full_logprobs(logits, sampled, t)
    except RuntimeError:
        check_finite(tr, logits.cpu(), row0)
        raise
    for r in torch.nonzero(~torch.isfinite(logp)).flatten().tolist():
        check_finite(tr, logits[r: r + 1].cpu(), row0 + r)
    return logp


def _replay(mask_replay, logits, sub, sampled, t, flagged, masks_path, row0):
    try:
        if bool(flagged.any()):
            # rows capture flagged as outside their support are left out of the metrics; let the op
            # fall back there, but a fallback on any other row is still a broken mask file
            logp, status = mask_replay.replay_logprobs(logits, sub, sampled, t, fallback=True, return_status=True)
            bad = torch.nonzero((status.cpu() != 0) & ~flagged)
            if bad.numel():
                r = int(bad[0])
                raise DumpError(f"{masks_path}: key 'sampled': token {int(sampled[r])} is outside the "
                                f"recorded support of row {row0 + r}")
            return logp
        return mask_replay.replay_logprobs(logits, sub, sampled, t)
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, DumpError):
            raise
        # the op's advice (fallback=True) is for Python callers; on the command line the fix is the file
        message = re.sub(r";? ?pass fallback=True.*", "", shift_row(str(exc), row0))
        raise DumpError(f"{masks_path}: key 'sampled': {message} (capture with --outside flag records such rows)") from exc
