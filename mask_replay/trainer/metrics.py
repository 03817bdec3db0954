"""Importance-ratio metrics of training log-probs against rollout log-probs, per token and per
sequence: the numbers `mask-replay score`, `demo`, `example` and `experiment` report.

With d = training - rollout log-prob of each sampled token and r = exp(d): k1 = E[-d] and
k3 = E[r - 1 - d] estimate KL(rollout || training) from rollout samples.
"""
from __future__ import annotations

import numpy as np
import torch

from mask_replay.csr import segment_sum

METRICS = ("importance_ratio_mean", "importance_ratio_median", "logp_diff_mean", "logp_diff_std",
           "kl_k1", "kl_k3", "chi2", "frac_outside_0.9_1.1")

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


# A token "differs" when its training and rollout log-probs are farther apart than this (nats), the
# threshold torchtitan's ratio_tokens_different uses: float32 recomputation noise is ~1e-7.
TOKENS_DIFFERENT_ABOVE = 1e-6


def support_kl_per_row(rollout_entries: torch.Tensor, training_entries: torch.Tensor, rows: torch.Tensor,
                       n: int) -> torch.Tensor:
    """KL(q || p) over each row's support, float64 [n]: q the rollout's per-entry log-probs (a mask's
    entry_logprobs), p the trainer's (replay_support_logprobs). An entry with q = 0 adds 0; one with
    q > 0 and p = 0 makes the row's KL +inf. Empty rows give 0."""
    lq, lp = rollout_entries.double(), training_entries.double()
    q = torch.exp(lq)
    terms = torch.where(q > 0, q * (lq - lp), torch.zeros_like(q))
    return segment_sum(terms, rows, n)


def support_metrics(kl: np.ndarray, d_replay: np.ndarray) -> dict:
    """The `support` section of score's report: support KL(q || p) per token (mean, max) and the share
    of tokens whose replayed log-prob differs from the rollout's by more than TOKENS_DIFFERENT_ABOVE."""
    kl, d = np.asarray(kl, dtype=np.float64), np.asarray(d_replay, dtype=np.float64)
    if kl.size == 0:
        return {"support_kl_mean": float("nan"), "support_kl_max": float("nan"),
                "ratio_tokens_different": float("nan")}
    with np.errstate(all="ignore"):
        return {"support_kl_mean": float(kl.mean()), "support_kl_max": float(kl.max()),
                "ratio_tokens_different": float((np.abs(d) > TOKENS_DIFFERENT_ABOVE).mean())}


def build_report(rollout, replay, no_replay, kept, step=None, sequence=None, support_kl=None) -> dict:
    """The JSON report (docs/formats.md, "Score report"); `support` only with support_kl (per token,
    when the mask file has entry_logprobs)."""
    d_rep, d_full = replay - rollout, no_replay - rollout
    report = {
        "tokens": int(rollout.size),
        "kept_mass_mean": float(np.mean(kept)) if kept.size else float("nan"),
        "replay": ratio_metrics(d_rep),
        "no_replay": ratio_metrics(d_full),
        "per_step": {},
    }
    if support_kl is not None:
        report["support"] = support_metrics(support_kl, d_rep)
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
