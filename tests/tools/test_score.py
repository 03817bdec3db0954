"""score_files streams its report: the same report as the in-memory computation (every row's log-probs
at once, then build_report on float64 arrays) for any chunk size, and no array as long as the dump
held while it runs."""
import gc
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mask_replay.files import mask_file
from mask_replay.mask import SamplingMask
from mask_replay.tools import score as score_mod
from mask_replay.tools import score_stats
from mask_replay.tools.score import score_files
from mask_replay.trainer.metrics import build_report, support_kl_per_row
from mask_replay.trainer.replay import full_logprobs, replay_logprobs
from mask_replay.trainer.support_logprobs import replay_support_logprobs
from tests.helpers import assert_same_report, report_scales, rollout_tensors, run, write

V = 12
CHUNK = 64  # rows per chunk of the memory test


def _dumps(tmp_path, n, seed, entries=True, outside=False):
    """A rollout of n rows (steps, sequences, greedy rows, a row whose sampled token is outside the
    support when `outside`), its mask file and a training dump near it with one -inf logit at a
    sampled token."""
    g = torch.Generator().manual_seed(seed)
    t = rollout_tensors(n=n, v=V, seed=seed, top_p=torch.tensor(0.9))
    t["step"] = torch.randint(0, 3, (n,), generator=g)
    t["sequence"] = torch.randint(0, 4, (n,), generator=g)
    t["temperature"] = torch.where(torch.rand(n, generator=g) < 0.1, 0.0, 0.7 + torch.rand(n, generator=g))
    if outside:
        t["sampled"][n // 2] = t["logits"][n // 2].argmin()
    rollout = write(tmp_path / f"r{seed}.safetensors", t)
    masks = tmp_path / f"m{seed}.safetensors"
    args = ["--entry-logprobs"] if entries else []
    res = run("capture", rollout, "-o", masks, "--outside", "flag" if outside else "error", *args)
    assert res.exit_code == 0, res.output
    z = t["logits"] + 0.3 * torch.randn(n, V, generator=g)
    z[1, t["sampled"][1]] = -float("inf")
    return str(masks), write(tmp_path / f"t{seed}.safetensors", {"logits": z})


def _in_memory_report(masks, training):
    """What score computed before it streamed: every row's log-probs in one call of each op, the rows
    it leaves out dropped, build_report on the float64 arrays."""
    m = SamplingMask.load(masks)
    z = load_file(training)["logits"]
    temp = m.extras["temperature"]
    greedy = temp == 0
    t = torch.where(greedy, torch.ones_like(temp), temp)
    flagged = m.extras.get("outside_support", torch.zeros(m.num_rows, dtype=torch.bool)).bool()
    unsampled = m.lengths() == 0
    full = full_logprobs(z, m.sampled, t).double().numpy()
    rep = replay_logprobs(z, m, m.sampled, t, fallback=True).double().numpy()
    rollout = m.logprobs.double().numpy()
    skip = (flagged | unsampled).numpy()
    keep = ~(greedy.numpy() | skip | ~np.isfinite(full) | ~np.isfinite(rollout))
    kl = None
    if m.entry_logprobs is not None:
        lp = replay_support_logprobs(z, m, temperature=t)
        kl = support_kl_per_row(m.entry_logprobs, lp, m.row_ids(), m.num_rows).numpy()[keep]
    step, seq = m.extras["step"].numpy()[keep], m.extras["sequence"].numpy()[keep]
    cols = (rollout[keep], rep[keep], full[keep], m.kept_mass.double().numpy()[keep], step, seq, kl)
    return build_report(*cols), report_scales(*cols)


@pytest.mark.parametrize("chunk_rows", [1, 7, None])
@pytest.mark.parametrize("seed, entries, outside", [(0, True, False), (1, False, True), (2, True, True)])
def test_streamed_report_equals_the_in_memory_one(tmp_path, monkeypatch, chunk_rows, seed, entries, outside):
    monkeypatch.setattr(score_stats, "BATCH", 16)  # many flushes and sorted runs even at 90 rows
    masks, training = _dumps(tmp_path, 90, seed, entries, outside)
    want, scales = _in_memory_report(masks, training)
    result = score_files(masks, training, chunk_rows=chunk_rows, progress=False)
    got = dict(result.report)
    assert set(got.pop("inputs")) == {"masks", "training"}
    assert ("support" in got) == entries and got["tokens"] < 90 and got["per_step"]
    assert_same_report(got, want, scales)
    assert any("greedy" in n for n in result.notes)
    assert any("-inf training log-prob" in n and "first row 1:" in n for n in result.notes), result.notes
    assert any("flagged by capture" in n for n in result.notes) == outside


def _live(cls) -> list:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on a deprecated torch alias warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, cls)]


def _per_row_arrays(rows: int, before: dict) -> list:
    """Tensors of `rows` elements or more made since `before` (id -> tensor, alive then: other tests'
    leftovers), the mask file's per-row keys included (a chunk of logits, chunk rows x V, is kept
    smaller than that)."""
    found = []
    for o in _live(torch.Tensor):
        if id(o) in before or o.numel() < rows:
            continue
        try:
            o.untyped_storage().data_ptr()
        except RuntimeError:  # a fake tensor (torch.compile tests): it holds no data
            continue
        found.append((o.dtype, tuple(o.shape)))
    return found


def _quiet(monkeypatch):
    monkeypatch.setattr(score_stats, "BATCH", 128)  # (below the smaller size: what waits is the same)
    # a median of up to LOAD_LIMIT values reads them (8 MB at most): here the bound is what is tested
    monkeypatch.setattr(score_stats, "LOAD_LIMIT", 512)
    # the files' identity hash reads through a 1 MB buffer, a peak of its own that would hide ~100
    # bytes a row at these sizes; it is not what is measured here
    monkeypatch.setattr(score_mod, "score_inputs", lambda *paths: {})


@pytest.mark.slow  # a memory measurement: seconds
def test_score_holds_no_per_row_array(tmp_path, monkeypatch):
    """While the chunks stream, nothing as long as the dump is alive, not even the mask file's
    per-row keys (tensors, found by the garbage collector), and the traced (numpy, Python) peak does
    not grow with the rows. The version that kept per-row arrays fails both: 4 float32/float64
    tensors of N rows, and ~128 traced bytes a row; the MaskFile that read its per-row keys whole at
    open fails the first (test_the_scan_sees_per_row_keys_held_whole)."""
    _quiet(monkeypatch)
    assert CHUNK * V < 1024
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ops' thread pool costs ~10 ms a call of tiny chunks on a busy machine
    try:
        peaks = {}
        for n in (1024, 8192):
            masks, training = _dumps(tmp_path, n, n, entries=False)
            assert _half_way_scan(monkeypatch, masks, training, n) == []
            tracemalloc.start()
            score_files(masks, training, chunk_rows=CHUNK, progress=False)
            peaks[n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        torch.set_num_threads(threads)
    grown = peaks[8192] - peaks[1024]
    # < 3 bytes a row: the runs' index, 16 bytes a run, 8 runs a batch (3 steps and all, 2 series)
    assert grown < 3 * (8192 - 1024), peaks


class _WholeKey(mask_file.RowKey):
    """A per-row key read whole at open and sliced in memory: what MaskFile did before RowKey."""

    def __init__(self, key: mask_file.RowKey):
        self.key, self.shape, self.dtype, self.t = key.key, key.shape, key.dtype, key.whole()

    def __getitem__(self, index):
        return self.t[index]


def test_the_scan_sees_per_row_keys_held_whole(tmp_path, monkeypatch):
    """The scan of the memory test finds a MaskFile's per-row keys when they are held whole (so it
    would fail the MaskFile that read them at open)."""
    _quiet(monkeypatch)
    real_open = mask_file.MaskFile._open

    def whole_open(self):
        real_open(self)
        for k in ("offsets", "sampled", "logprobs", "kept_mass"):
            setattr(self, k, _WholeKey(getattr(self, k)))
        self.extras = {k: _WholeKey(v) for k, v in self.extras.items()}

    monkeypatch.setattr(mask_file.MaskFile, "_open", whole_open)
    n = 1024
    masks, training = _dumps(tmp_path, n, n, entries=False)
    found = _half_way_scan(monkeypatch, masks, training, n)
    assert (torch.int64, (n + 1,)) in found and (torch.float32, (n,)) in found, found


def _half_way_scan(monkeypatch, masks, training, n) -> list:
    """Scores the files (chunks of CHUNK rows) and returns the tensors of n elements or more alive
    half-way through the rows (_per_row_arrays)."""
    seen = []
    real_add = score_stats.ReportStream.add
    added = [0]

    def add(self, *cols):
        added[0] += cols[0].size
        if not seen and added[0] > n // 2:  # half-way through the rows
            seen.append(_per_row_arrays(n, before))
        return real_add(self, *cols)

    monkeypatch.setattr(score_stats.ReportStream, "add", add)
    before = {id(o): o for o in _live(torch.Tensor)}  # kept alive, so no id is reused
    try:
        score_files(masks, training, chunk_rows=CHUNK, progress=False)  # also warms first-call allocations
    finally:
        monkeypatch.setattr(score_stats.ReportStream, "add", real_add)
    assert seen
    return seen[0]
