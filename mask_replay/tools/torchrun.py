"""`capture` and `score` under torchrun: each rank streams a contiguous share of the rows, rank 0
merges and writes exactly what one process would have written.

capture: rank r captures rows share(N, P, r) of the concatenated inputs (mask_replay.tools.capture
with rows=...), rank 0 gathers the per-rank masks in rank order, concatenates them and writes the
single mask file asked for, with the tensors and metadata a single process writes (not its bytes:
the streamed single-process file keeps spare header room, padded with spaces).
score: rank r computes the per-token log-probs (replay and full vocabulary) of its rows; rank 0
gathers them in global row order and builds the report with the single-process code, so no digit
depends on the number of ranks. The JSON's `run` section (world size, rows per rank) is the only
rank-dependent part.

Failures: every rank reports success or its first error at one agreement point; rank 0 prints the
first error in rank order and all exit 1 before anything is written. Outputs are written by rank 0
only, atomically.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from mask_replay.errors import DumpError
from mask_replay.files.dumps import Dump
from mask_replay.files.safe_output import check_writable
from mask_replay.mask import SamplingMask
from mask_replay.sampler.profiles.mismatch import DEFAULT_TOLERANCE, summarise
from mask_replay.tools.capture import CaptureSummary, capture_dumps
from mask_replay.tools.launch import RunFailed, process_group, share
from mask_replay.tools.score import score_files


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, OSError) and not isinstance(exc, DumpError):
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else text
    return text.splitlines()[0] if text else type(exc).__name__


def _total_rows(paths) -> int:
    total = 0
    for p in paths:
        with Dump(p) as d:
            total += d.require_rollout()[0]
    return total


def capture_under_torchrun(paths, out, *, device="cpu", outside="error", progress=True, **capture_args):
    """mask_replay.tools.capture as one rank of torchrun (same arguments): returns the summary of
    the whole capture on rank 0, None on the other ranks."""

    with process_group(device) as ranks:
        t0 = time.perf_counter()
        summary, error = None, None
        try:
            n = _total_rows(paths)
            if ranks.rank == 0:
                _check_output(paths, out)
                check_writable(out)
            summary = capture_dumps(paths, None, device=device, outside=outside, rows=ranks.share(n),
                                    progress=progress and ranks.rank == 0, **capture_args)
        except (DumpError, OSError) as exc:
            error = _line(exc)
        ranks.agree(error)
        parts = ranks.gather_to_0((summary.mask, summary.bytes_read, summary.notes))
        if ranks.rank != 0:
            return None
        mask = merge_masks([p[0] for p in parts], outside)
        # Each rank's summary covers its own rows only (row numbers relative to its share): the
        # report of the whole run is recomputed from the merged per-row values, as one process does.
        mismatch = _merged_mismatch(mask, capture_args.get("logprob_tolerance"))
        if mismatch is not None:
            mask.metadata["logprob_mismatch"] = mismatch
        mask.save(out)
        outside_rows = int(mask.extras["outside_support"].sum()) if "outside_support" in mask.extras else 0
        notes = summary.notes + [_ranks_note([p[0].num_rows for p in parts])]
        return CaptureSummary(mask.num_rows, mask.nnz, summary.vocab, mask.lengths(), sum(p[1] for p in parts),
                              os.path.getsize(out), time.perf_counter() - t0, outside_rows, notes, mask, mismatch)


def _merged_mismatch(mask, tolerance):
    """capture_dumps' log-prob mismatch report over the merged mask (None when no dump had
    rollout_logprobs): its inputs are the per-row codes, engine and capture log-probs."""

    if "logprob_mismatch" not in mask.extras:
        return None
    tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
    return summarise(mask.extras["logprob_mismatch"], mask.logprobs, mask.extras["capture_logprobs"], tol)


def _ranks_note(rows) -> str:
    return f"torchrun: {len(rows)} ranks, rows per rank {rows}"


def _check_output(paths, out):
    for p in paths:
        if os.path.exists(out) and os.path.exists(p) and os.path.samefile(p, out):
            raise DumpError(f"{out}: output would overwrite the input dump")


def merge_masks(masks, outside):
    """Per-rank masks, in rank order, as the one mask a single process captures."""

    parts = [m for m in masks if m.num_rows > 0] or masks[:1]
    if outside == "flag":  # a rank without flagged rows dropped the (all-false) column
        for m in parts:
            m.extras.setdefault("outside_support", torch.zeros(m.num_rows, dtype=torch.bool))
    mask = SamplingMask.concat(parts)
    mask.metadata = dict(masks[0].metadata)
    if "outside_support" in mask.extras and not bool(mask.extras["outside_support"].any()):
        del mask.extras["outside_support"]  # written only when some row was flagged, as in one process
    return mask


def score_under_torchrun(masks, training, *, chunk_rows=None, device="cpu", progress=True):
    """mask_replay.score_files as one rank of torchrun: returns the ScoreResult of all rows (its
    report with a `run` section) on rank 0, None on the other ranks."""

    with process_group(device) as ranks:
        state = {"combined": False, "rows": None}

        def combine(*arrays):  # each rank's share of every per-row array, in global row order on rank 0
            state["combined"] = True
            ranks.agree(None)
            parts = ranks.gather_to_0(tuple(a.numpy() for a in arrays))
            if ranks.rank != 0:
                return None
            return tuple(torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in range(len(arrays)))

        try:
            with Dump(masks) as d:
                if "offsets" not in d or len(d.shape("offsets")) != 1:
                    raise DumpError(f"{masks}: missing key 'offsets' (is this a mask file?)")
                n = max(d.shape("offsets")[0] - 1, 0)
            state["rows"] = [b - a for a, b in (share(n, ranks.world, r) for r in range(ranks.world))]
            result = score_files(masks, training, chunk_rows=chunk_rows, device=device,
                                 progress=progress and ranks.rank == 0, rows=ranks.share(n), combine=combine)
        except (DumpError, OSError) as exc:
            if state["combined"]:  # rank 0 alone, after the others finished: a plain error
                raise
            ranks.agree(_line(exc))
            raise RunFailed("unreachable: agree() raises on an error") from exc
        if result is not None:
            result.report["run"] = {"world_size": ranks.world, "rows_per_rank": state["rows"]}
            result.notes.append(_ranks_note(state["rows"]))
        return result

