"""Score's report accumulated batch by batch, in memory that does not grow with the rows: the same
numbers as trainer/metrics.build_report computes on whole float64 arrays.

- means: exact sums (ExactSum: the correctly rounded sum of the batch sums), so a mean differs from
  numpy's pairwise one by rounding only (a few ulp); counts and maxima are exact;
- standard deviations: Chan's pairwise merge of (count, sum, sum of squared deviations) per batch;
- medians: exact. A median needs every value (no one-pass sketch is exact), so they wait on disk,
  not in memory: each batch's d values are sorted and appended to a temporary file (MedianSpill:
  8 bytes per token and series, twice that when there are steps: sorted by value, and by step then
  value). A median of up to LOAD_LIMIT values reads them and partitions; a larger one is found by
  bisection over the sorted runs, which reads O(log n) pages of each;
- sequences: one log-ratio sum per (step, sequence) pair, 24 bytes a sequence (not a token), added in
  row order with np.add.at, so each is the same float as build_report's np.bincount.
"""
from __future__ import annotations

import math
import tempfile
from array import array
from typing import Optional

import numpy as np

from mask_replay.trainer.metrics import METRICS, TOKENS_DIFFERENT_ABOVE, sequence_metrics

_SIGN = np.uint64(1 << 63)
# tokens gathered before they are added (sorted, written, summed): bounds both the memory held for
# them (~100 bytes a token) and the per-batch overhead
BATCH = 1 << 16
# a median of at most this many values reads them (8 bytes each) and partitions; more, it bisects
LOAD_LIMIT = 1 << 20


class ExactSum:
    """A float64 sum kept exact (Shewchuk's non-overlapping partials, as math.fsum) over the values
    added; non-finite values are summed apart (inf + -inf = nan, as numpy)."""

    def __init__(self):
        self.partials: list = []
        self.special = 0.0

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            self.special += x
            return
        kept = []
        for y in self.partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                kept.append(lo)
            x = hi
        if math.isinf(x):  # the finite partials overflowed: the sum is that infinity
            self.partials, self.special = [], self.special + x
            return
        kept.append(x)
        self.partials = kept

    def value(self) -> float:
        if self.special != 0.0 or math.isnan(self.special):
            return self.special
        try:
            return math.fsum(self.partials)
        except OverflowError:
            return math.copysign(math.inf, self.partials[-1])


class Moments:
    """Count, exact sum and Chan's M2 (sum of squared deviations) of a float64 series, for its mean
    and population standard deviation (numpy's std, ddof 0)."""

    def __init__(self):
        self.n, self.sum, self.m2, self.nonfinite = 0, ExactSum(), 0.0, False

    def add(self, x: np.ndarray) -> None:
        if not x.size:
            return
        with np.errstate(all="ignore"):
            s = float(np.sum(x))
            if not math.isfinite(s) or not np.isfinite(x).all():
                self.nonfinite = True  # numpy's std is nan then (inf - inf): no M2 to keep
            else:
                mean_b = s / x.size
                m2_b = float(np.sum((x - mean_b) ** 2))
                if self.n:
                    delta = mean_b - self.sum.value() / self.n
                    self.m2 += m2_b + delta * delta * (self.n * x.size / (self.n + x.size))
                else:
                    self.m2 = m2_b
        self.n += x.size
        self.sum.add(s)

    def mean(self) -> float:
        return self.sum.value() / self.n if self.n else math.nan

    def std(self) -> float:
        if not self.n or self.nonfinite:
            return math.nan
        return math.sqrt(max(self.m2, 0.0) / self.n)


def float_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys ordered as the float64 values (-0.0 just below 0.0; no NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_floats(k: np.ndarray) -> np.ndarray:
    k = np.asarray(k, dtype=np.uint64)
    return np.where(k & _SIGN, k ^ _SIGN, ~k).view(np.float64)


class MedianSpill:
    """The exact median of exp(d) per group and over all groups, with the d values on disk: each
    batch is sorted by value (by group, then value, a second time when there are groups) and
    appended to one file; `runs` indexes it (group, None for all -> offset, count, offset, ...: 16
    bytes a run), so the index grows with batches x groups, never with tokens."""

    def __init__(self, folder: Optional[str], by_group: bool):
        self.folder = tempfile.gettempdir() if folder is None else folder
        # a file without a name (unlinked at once): the system frees it when this process ends,
        # however it ends (SIGKILL included)
        try:
            self.file = tempfile.TemporaryFile(prefix="mask-replay-score-", dir=self.folder)
        except OSError as exc:
            raise self._where(exc) from exc
        self.by_group = by_group
        self.written = 0
        self.runs: dict = {}
        self.nan: dict = {}  # group (None: any) -> True when some d is NaN: its median is NaN, as numpy's

    def add(self, group: np.ndarray, d: np.ndarray) -> None:
        nan = np.isnan(d)
        if nan.any():
            for g in [None] + np.unique(group[nan]).tolist():
                self.nan[g] = True
            group, d = group[~nan], d[~nan]
        if not d.size:
            return
        keys = float_keys(d)
        if self.by_group:
            order = np.lexsort((keys, group))
            grouped, group = keys[order], group[order]
            starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
            ends = np.r_[starts[1:], group.size]
            for a, b, g in zip(starts.tolist(), ends.tolist(), group[starts].tolist()):
                self.runs.setdefault(g, array("q")).extend((self.written + a, b - a))
            self._write(grouped)
        self.runs.setdefault(None, array("q")).extend((self.written, keys.size))
        self._write(np.sort(keys))

    def _write(self, keys: np.ndarray) -> None:
        try:
            self.file.write(keys.tobytes())
        except OSError as exc:  # a full disk: say which folder, and how to choose another
            raise self._where(exc) from exc
        self.written += keys.size

    def _where(self, exc: OSError) -> OSError:
        return OSError(exc.errno, f"{exc.strerror or exc} (score's median values, 8-16 bytes a token each for "
                                  "replay and no replay; set TMPDIR to a folder with room)", self.folder)

    def median(self, group=None) -> float:
        """np.median(np.exp(d)) over the group's values (every group's with None)."""
        flat = self.runs.get(group, array("q"))
        runs = list(zip(flat[0::2], flat[1::2]))
        n = sum(c for _, c in runs)
        if self.nan.get(group, False) or not n:
            return math.nan
        self.file.flush()
        data = np.memmap(self.file, dtype=np.uint64, mode="r", shape=(self.written,))
        ks = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
        segs = []
        try:
            segs = [data[o: o + c] for o, c in runs]
            if n <= LOAD_LIMIT:  # few enough to read: one partition
                vals = np.concatenate(segs)
                vals.partition(ks)  # in place: one copy of the values at most
                picked = vals[ks]
            else:
                picked = np.array([_kth(segs, k) for k in ks], dtype=np.uint64)
        finally:
            del data, segs  # unmapped with its last view: the pages read leave this process
        with np.errstate(over="ignore"):
            r = np.exp(key_floats(picked))
        return float(r[0]) if r.size == 1 else float((r[0] + r[1]) / 2)

    def close(self) -> None:
        self.file.close()


def _kth(segs, k: int) -> int:
    """The k-th smallest (0-based) key over sorted uint64 segments: the least v with more than k
    keys <= v, by bisection over the key space (64 steps, each a searchsorted per segment)."""
    lo, hi = 0, (1 << 64) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        v = np.uint64(mid)
        if sum(int(np.searchsorted(s, v, side="right")) for s in segs) > k:
            hi = mid
        else:
            lo = mid + 1
    return lo


class RatioStats:
    """ratio_metrics(d) accumulated: d = training - rollout log-prob per token, r = exp(d)."""

    def __init__(self):
        self.d = Moments()
        self.r, self.k3, self.r2 = ExactSum(), ExactSum(), ExactSum()
        self.outside = 0

    def add(self, d: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            r = np.exp(d)
            self.r.add(float(np.sum(r)))
            self.k3.add(float(np.sum(r - 1.0 - d)))
            self.r2.add(float(np.sum(r * r)))
            self.outside += int(np.count_nonzero((r < 0.9) | (r > 1.1)))
        self.d.add(d)

    def metrics(self, median: float) -> dict:
        n = self.d.n
        if not n:
            return {k: float("nan") for k in METRICS}
        mean_d = self.d.mean()
        return {
            "importance_ratio_mean": self.r.value() / n,
            "importance_ratio_median": median,
            "logp_diff_mean": mean_d,
            "logp_diff_std": self.d.std(),
            "kl_k1": -mean_d,
            "kl_k3": self.k3.value() / n,
            "chi2": self.r2.value() / n - 1.0,
            "frac_outside_0.9_1.1": self.outside / n,
        }


class _Group:
    def __init__(self):
        self.kept = Moments()
        self.replay, self.no_replay = RatioStats(), RatioStats()


class _Sequences:
    """Per (step, sequence) sums of d, one sorted int64 array of sequence ids per step."""

    def __init__(self):
        self.by_step: dict = {}  # step -> [sorted ids, replay sums, no-replay sums]

    def add(self, step: np.ndarray, seq: np.ndarray, d_rep: np.ndarray, d_full: np.ndarray) -> None:
        for s in np.unique(step).tolist():
            sel = step == s
            ids = seq[sel]
            ent = self.by_step.setdefault(s, [np.zeros(0, np.int64), np.zeros(0), np.zeros(0)])
            new = np.setdiff1d(ids, ent[0])
            if new.size:
                at = np.searchsorted(ent[0], new)
                ent[0] = np.insert(ent[0], at, new)
                ent[1], ent[2] = np.insert(ent[1], at, 0.0), np.insert(ent[2], at, 0.0)
            slot = np.searchsorted(ent[0], ids)
            np.add.at(ent[1], slot, d_rep[sel])  # row order, as np.bincount adds
            np.add.at(ent[2], slot, d_full[sel])

    def metrics(self):
        steps = sorted(self.by_step)
        keys = np.concatenate([np.stack([np.full(self.by_step[s][0].size, s, np.int64), self.by_step[s][0]], 1)
                               for s in steps]) if steps else np.zeros((0, 2), np.int64)
        rep = np.concatenate([self.by_step[s][1] for s in steps]) if steps else np.zeros(0)
        full = np.concatenate([self.by_step[s][2] for s in steps]) if steps else np.zeros(0)
        # one value per key: sequence_metrics' own bincount adds each to 0.0, leaving it as it is
        return sequence_metrics(rep, keys), sequence_metrics(full, keys)


class ReportStream:
    """build_report(rollout, replay, no_replay, kept, step, sequence, support_kl) over batches of
    tokens (float64 arrays; step/sequence int64 or None; support_kl per token or None): add() each
    batch of tokens, report() at the end. Use as a context manager (it closes the median files)."""

    def __init__(self, has_step: bool, has_sequence: bool, has_support: bool, folder: Optional[str] = None):
        self.has_step, self.has_sequence, self.has_support = has_step, has_sequence, has_support
        self.spill = {k: MedianSpill(folder, has_step) for k in ("replay", "no_replay")}
        self.all = _Group()
        self.steps: dict = {}
        self.sequences = _Sequences() if has_sequence else None
        self.kl, self.kl_max, self.kl_nan, self.different = ExactSum(), -math.inf, False, 0
        self._waiting, self._waiting_n = [], 0

    def add(self, rollout, replay, no_replay, kept, step=None, sequence=None, support_kl=None) -> None:
        """One batch of tokens; kept until BATCH tokens are waiting, so that a caller's small chunks
        (--chunk-rows 1) still cost one sort and one file write per BATCH tokens."""
        if not rollout.size:
            return
        self._waiting.append((rollout, replay, no_replay, kept, step, sequence, support_kl))
        self._waiting_n += rollout.size
        if self._waiting_n >= BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self._waiting:
            return
        cols = list(zip(*self._waiting))
        self._waiting, self._waiting_n = [], 0
        rollout, replay, no_replay, kept, step, sequence, support_kl = (
            None if c[0] is None else np.concatenate(c) for c in cols)
        d_rep, d_full = replay - rollout, no_replay - rollout
        groups = step if self.has_step else np.zeros(rollout.size, np.int64)
        self.spill["replay"].add(groups, d_rep)
        self.spill["no_replay"].add(groups, d_full)
        self._add_group(self.all, d_rep, d_full, kept)
        if self.has_step:
            for s in np.unique(step).tolist():
                sel = step == s
                self._add_group(self.steps.setdefault(s, _Group()), d_rep[sel], d_full[sel], kept[sel])
        if self.sequences is not None:
            self.sequences.add(groups, sequence, d_rep, d_full)
        if self.has_support:
            self.kl.add(float(np.sum(support_kl)))
            if np.isnan(support_kl).any():
                self.kl_nan = True
            else:
                self.kl_max = max(self.kl_max, float(np.max(support_kl)))
            self.different += int(np.count_nonzero(np.abs(d_rep) > TOKENS_DIFFERENT_ABOVE))

    @staticmethod
    def _add_group(g: _Group, d_rep, d_full, kept):
        g.kept.add(kept)
        g.replay.add(d_rep)
        g.no_replay.add(d_full)

    def report(self) -> dict:
        self._flush()
        n = self.all.kept.n
        report = {
            "tokens": n,
            "kept_mass_mean": self.all.kept.mean(),
            "replay": self.all.replay.metrics(self.spill["replay"].median()),
            "no_replay": self.all.no_replay.metrics(self.spill["no_replay"].median()),
            "per_step": {},
        }
        if self.has_support:
            report["support"] = {
                "support_kl_mean": self.kl.value() / n if n else math.nan,
                "support_kl_max": (math.nan if self.kl_nan else self.kl_max) if n else math.nan,
                "ratio_tokens_different": self.different / n if n else math.nan}
        if self.sequences is not None and n:
            seq_rep, seq_full = self.sequences.metrics()
            report["replay"].update(seq_rep)
            report["no_replay"].update(seq_full)
        for s in sorted(self.steps):
            g = self.steps[s]
            report["per_step"][str(int(s))] = {
                "tokens": g.kept.n,
                "kept_mass_mean": g.kept.mean(),
                "replay": g.replay.metrics(self.spill["replay"].median(s)),
                "no_replay": g.no_replay.metrics(self.spill["no_replay"].median(s)),
            }
        return report

    def close(self) -> None:
        for s in self.spill.values():
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
