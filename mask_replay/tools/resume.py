"""`--resume`: skip a command whose outputs are already complete.

Outputs are written atomically (a temporary file renamed into place), so an output that exists
was written whole; what remains to check is that it answers *this* command:
  capture: the mask file's metadata names the same input files (in order: resolved paths and content
           identity, files/identity.py, not base names), the same parameter
           sources and values, the same `--outside` and profile (semantics), the same
           `--logprob-tol` when it holds a log-prob mismatch report, and it has as many rows as
           the inputs;
  score:   the JSON parses as a score report whose `inputs` are the identities of this command's
           --masks and --training files (a report of another dump, or of one rewritten since, is
           not kept), and the plot exists when one is asked for.
Anything else (missing, unreadable, made for other inputs) is recomputed and replaced.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from mask_replay.errors import DumpError
from mask_replay.files.dumps import PARAM_KEYS, Dump
from mask_replay.files.identity import file_identity, source_names
from mask_replay.sampler.profiles import semantics
from mask_replay.tools.capture import _param_source
from mask_replay.tools.score import score_inputs


def _note(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once per run under torchrun
        print(f"mask-replay: note: {message}", file=sys.stderr, flush=True)


def capture_complete(paths, out, *, flags: dict, explicit, outside: str, profile: str = "exact",
                     logprob_tolerance: Optional[float] = None, entry_logprobs: bool = False) -> bool:
    """True (and a note) when `out` is the complete mask file of this capture."""

    if not os.path.isfile(out):
        return False
    try:
        with Dump(out) as m:
            meta, rows = m.metadata, m.shape("offsets")[0] - 1 if "offsets" in m else -1
            has_entries = "entry_logprobs" in m
        total, params = 0, {}
        names = source_names(paths)
        for name, p in zip(names, paths):
            with Dump(p) as d:
                total += d.require_rollout()[0]
                params[name] = {k: _param_source(d, k, flags, set(explicit)) for k in PARAM_KEYS}
        same = (json.loads(meta.get("sources", "null")) == names
                and json.loads(meta.get("inputs", "null")) == [file_identity(p) for p in paths]
                and json.loads(meta.get("params", "null")) == params
                and meta.get("outside") == outside and meta.get("semantics") == semantics(profile)
                and rows == total and has_entries == bool(entry_logprobs)
                # the per-row log-prob mismatch codes depend on --logprob-tol: a report made with
                # another tolerance is not this command's output
                and (logprob_tolerance is None or "logprob_mismatch" not in meta
                     or _report_tolerance(meta["logprob_mismatch"]) == logprob_tolerance))
    except (DumpError, OSError, ValueError, KeyError):
        return False
    if same:
        _note(f"{out} is complete for these inputs: skipped (--resume)")
    return same


def _report_tolerance(text: str):
    report = json.loads(text)
    return report.get("tolerance") if isinstance(report, dict) else None


def score_complete(json_out, plot, masks, training) -> bool:
    """True (and a note) when the JSON report (and the plot, if asked for) are there, whole, and made
    from these --masks and --training files."""
    if not json_out or not os.path.isfile(json_out) or (plot and not os.path.isfile(plot)):
        return False
    try:
        with open(json_out) as f:
            report = json.load(f)
        whole = isinstance(report, dict) and {"tokens", "replay", "no_replay", "per_step"} <= report.keys()
        current = score_inputs(masks, training)
    except (OSError, ValueError):
        return False
    if not whole:
        return False
    if report.get("inputs") != current:
        _note(f"{json_out} was not made from these --masks and --training files: recomputed (--resume)")
        return False
    _note(f"{json_out} is complete: skipped (--resume)")
    return True
