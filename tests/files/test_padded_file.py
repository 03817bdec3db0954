"""Padded files converted chunk by chunk (padded_to_mask_file, mask_file_to_padded) against the
whole-mask path (load_padded + save, load + save_padded): the same bytes for any chunk size, the
same errors naming the same row, nothing written on bad input, and memory that does not grow with
the rows."""
import ctypes
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mask_replay import SamplingMask
from mask_replay.errors import DumpError, InputError
from mask_replay.files import padded_file
from mask_replay.files.padded_file import load_padded, mask_file_to_padded, padded_to_mask_file, save_padded
from tests.helpers import assert_clean, write

VOCAB = 40


def normalised(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return (x - torch.logsumexp(x, 0)).float() if n else torch.zeros(0)


def random_mask(seed: int, rows: int, entries: bool, extras: bool) -> SamplingMask:
    """Rows of 0..6 distinct ids; with `extras`, sampled (in its row), logprobs and kept_mass,
    a sequence id, and 1-byte per-row keys (the file's tail tensors)."""
    g = torch.Generator().manual_seed(seed)
    lists = [sorted(torch.randperm(VOCAB, generator=g)[:int(torch.randint(0, 7, (1,), generator=g))].tolist())
             for _ in range(rows)]
    mask = SamplingMask.from_lists(lists)
    if entries:
        mask.entry_logprobs = torch.cat([normalised(len(r), g) for r in lists]) if rows else torch.zeros(0)
    if extras:
        mask.sampled = torch.tensor([r[0] if r else 0 for r in lists], dtype=torch.int64)
        mask.logprobs = -torch.rand(rows, generator=g)
        mask.kept_mass = torch.rand(rows, generator=g)
        mask.extras = {"sequence": torch.arange(rows) // 3, "outside_support": torch.rand(rows, generator=g) > 0.5,
                       "logprob_mismatch": torch.randint(-1, 3, (rows,), generator=g, dtype=torch.int8)}
        mask.metadata = {"engine": "test", "step": 3}
    return mask


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def shuffled_padded(mask: SamplingMask, width: int, g: torch.Generator):
    """ids [N, width] with each row's ids in random order, as engines write them, -1 after; entry
    log-probs permuted with them, padding NaN (never read)."""
    ids, counts, *lp = mask.to_padded(width)
    for r in range(mask.num_rows):
        k = int(counts[r])
        p = torch.randperm(k, generator=g)
        ids[r, :k] = ids[r, :k][p]
        if lp:
            lp[0][r, :k] = lp[0][r, :k][p]
            lp[0][r, k:] = float("nan")
    return ids, counts, (lp[0] if lp else None)


CHUNKS = st.sampled_from([1, 2, 3, 7, 1000, None])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 30), entries=st.booleans(), extras=st.booleans(),
       chunk=CHUNKS, extra_width=st.integers(0, 3))
@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
def test_chunked_convert_writes_the_bytes_of_the_whole_mask_path(seed, rows, entries, extras, chunk, extra_width):
    mask = random_mask(seed, rows, entries, extras)
    widest = int(mask.lengths().max()) if rows else 0
    with tempfile.TemporaryDirectory() as d:
        m, want, got = (os.path.join(d, n) for n in ("m.safetensors", "want.safetensors", "got.safetensors"))
        mask.save(m)
        for width in (None, widest + extra_width):  # the widest row, and wider
            save_padded(SamplingMask.load(m), want, width)
            mask_file_to_padded(m, got, width, chunk_rows=chunk)
            assert read(got) == read(want)
        # back: a padded file whose rows are in engine order (unsorted), wider than needed
        ids, counts, lp = shuffled_padded(mask, widest + extra_width, torch.Generator().manual_seed(seed))
        tensors = {k: v for k, v in mask.tensors().items() if k not in ("token_ids", "offsets", "entry_logprobs")}
        tensors.update({"ids": ids, "counts": counts})
        if lp is not None:
            tensors["entry_logprobs"] = lp
        p = write(os.path.join(d, "p.safetensors"), tensors)
        load_padded(p).save(want)
        padded_to_mask_file(p, got, chunk_rows=chunk)
        assert read(got) == read(want)
        assert SamplingMask.load(got) == mask  # and the mask itself came back


def test_every_chunk_is_seen_once_in_order(tmp_path):
    mask = random_mask(1, 23, True, True)
    mask.save(tmp_path / "m.safetensors")
    seen = []
    mask_file_to_padded(tmp_path / "m.safetensors", tmp_path / "p.safetensors", chunk_rows=5, each=seen.append)
    assert [c.num_rows for c in seen] == [5, 5, 5, 5, 3]
    again = []
    padded_to_mask_file(tmp_path / "p.safetensors", tmp_path / "b.safetensors", chunk_rows=4, each=again.append)
    assert [c.num_rows for c in again] == [4] * 5 + [3]
    assert SamplingMask.concat(again) == SamplingMask.concat(seen) == SamplingMask.load(tmp_path / "b.safetensors")


# ---- bad rows in a later chunk ----------------------------------------------------------------------
ROW = 7  # in the third chunk of 3 rows


def later_row_mask() -> SamplingMask:
    """10 rows, row ROW with at least two ids (the cases below need them)."""
    return next(m for m in (random_mask(s, 10, True, True) for s in range(100)) if int(m.lengths()[ROW]) >= 2)


def _padded_case(case):
    """A padded file of 10 rows, good but for row ROW: (tensors, vocab_size)."""
    mask = later_row_mask()
    ids, counts, lp = mask.to_padded(8)
    tensors = {k: v for k, v in mask.tensors().items() if k not in ("token_ids", "offsets", "entry_logprobs")}
    vocab = None
    k = int(counts[ROW])
    if case == "duplicate":
        ids[ROW, 1] = ids[ROW, 0]
    elif case == "negative id":
        ids[ROW, 0] = -3
    elif case == "padding":
        ids[ROW, 7] = 5
    elif case == "count > width":
        counts[ROW] = 9
    elif case == "negative count":
        counts[ROW] = -1
    elif case == "sampled":
        tensors["sampled"][ROW] = next(v for v in range(VOCAB) if v not in ids[ROW, :k].tolist())
    elif case == "entry nan":
        lp[ROW, 1] = float("nan")
    elif case == "entry +inf":
        lp[ROW, 0] = float("inf")
    elif case == "entry not normalised":
        lp[ROW, :k] -= 1.0
    elif case == "entry -1e300":  # finite in float64, -inf in float32: refused, not made probability 0
        lp = lp.double()
        lp[ROW, :k] = -1e300
    elif case == "kept_mass":
        tensors["kept_mass"][ROW] = 2.0
    elif case == "logprobs":
        tensors["logprobs"][ROW] = 3.0
    elif case == "vocab":
        ids[ROW, 0], vocab = VOCAB + 5, VOCAB
    tensors.update({"ids": ids, "counts": counts, "entry_logprobs": lp})
    return tensors, vocab


PADDED_CASES = ["duplicate", "negative id", "padding", "count > width", "negative count", "sampled", "entry nan",
                "entry +inf", "entry not normalised", "entry -1e300", "kept_mass", "logprobs", "vocab"]


@pytest.mark.parametrize("case", PADDED_CASES)
def test_bad_row_in_a_later_chunk_of_a_padded_file(tmp_path, case):
    tensors, vocab = _padded_case(case)
    p = write(tmp_path / "p.safetensors", tensors)
    with pytest.raises(InputError) as whole:  # the whole-mask path, as convert ran it before
        load_padded(p).validate(vocab_size=vocab, source=p)
    assert f"row {ROW}" in str(whole.value)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"before")
    with pytest.raises(InputError) as chunked:
        padded_to_mask_file(p, out, vocab_size=vocab, chunk_rows=3)
    assert str(chunked.value) == str(whole.value)
    assert out.read_bytes() == b"before"
    assert_clean(tmp_path)


MASK_CASES = ["not ascending", "vocab", "entry nan", "entry +inf", "entry not normalised", "kept_mass", "wider"]


@pytest.mark.parametrize("case", MASK_CASES)
def test_bad_row_in_a_later_chunk_of_a_mask_file(tmp_path, case):
    mask = later_row_mask()
    lo, hi = int(mask.offsets[ROW]), int(mask.offsets[ROW + 1])
    vocab, width = None, None
    if case == "not ascending":
        mask.token_ids[lo], mask.token_ids[lo + 1] = mask.token_ids[lo + 1].clone(), mask.token_ids[lo].clone()
    elif case == "vocab":
        mask.token_ids[hi - 1], vocab = VOCAB + 5, VOCAB  # still the row's largest
    elif case == "entry nan":
        mask.entry_logprobs[lo] = float("nan")
    elif case == "entry +inf":
        mask.entry_logprobs[lo] = float("inf")
    elif case == "entry not normalised":
        mask.entry_logprobs[lo:hi] -= 1.0
    elif case == "kept_mass":
        mask.kept_mass[ROW] = -0.5
    elif case == "wider":  # only row ROW is wider than the width
        lists = [[1, 2]] * 10
        lists[ROW] = [1, 2, 3, 4, 5]
        mask, width = SamplingMask.from_lists(lists), 4
    m = write(tmp_path / "m.safetensors", mask.tensors())  # the reference writer
    with pytest.raises(ValueError) as whole:
        save_padded(SamplingMask.load(m).validate(vocab_size=vocab, source=m), tmp_path / "whole.safetensors", width)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"before")
    with pytest.raises(ValueError) as chunked:
        mask_file_to_padded(m, out, width, vocab_size=vocab, chunk_rows=3)
    assert f"row {ROW}" in str(whole.value) and str(chunked.value) == str(whole.value)
    assert out.read_bytes() == b"before"
    assert_clean(tmp_path)


def test_a_padded_file_larger_than_the_free_disk_is_refused_before_writing(tmp_path, monkeypatch):
    SamplingMask.from_lists([[1, 2], [3]]).save(tmp_path / "m.safetensors")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(padded_file.shutil, "disk_usage", lambda folder: usage._replace(free=100))
    out = tmp_path / "p.safetensors"
    with pytest.raises(DumpError, match=r"p.safetensors: the padded file \(width 1000\) would take 8,008 bytes, "
                                        r"more than the 100 free"):
        mask_file_to_padded(tmp_path / "m.safetensors", out, 1000)  # ids 2 x 1000 x 4 + counts 2 x 4
    assert_clean(tmp_path, "p.safetensors")
    mask_file_to_padded(tmp_path / "m.safetensors", out, 2)  # 24 bytes: not refused
    assert load_padded(out) == SamplingMask.load(tmp_path / "m.safetensors")


# ---- memory -----------------------------------------------------------------------------------------
def _heap_bytes():
    """Bytes glibc's malloc has handed out and not taken back (arenas + mmapped blocks): every CPU
    tensor's storage among them. None where mallinfo2 is missing (not glibc, or glibc < 2.33)."""
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = Info
    return lambda: (lambda i: i.uordblks + i.hblkhd)(fn())


def _peak_above(monkeypatch, run) -> int:
    """The most heap bytes above the start, sampled after every read of a padded input, every padded
    chunk made, and at every chunk's end."""
    heap = _heap_bytes()
    samples = []

    def sampled(fn):
        def call(*args):
            out = fn(*args)
            samples.append(heap())
            return out
        return call

    monkeypatch.setattr(padded_file, "pread_rows", sampled(padded_file.pread_rows))
    monkeypatch.setattr(padded_file, "to_padded", sampled(padded_file.to_padded))
    start = heap()
    run(lambda chunk: samples.append(heap()))
    monkeypatch.undo()
    return max(samples) - start


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
@pytest.mark.skipif(_heap_bytes() is None, reason="needs glibc's mallinfo2")
def test_memory_does_not_grow_with_rows(tmp_path, monkeypatch):
    """Eight times the rows, the same peak (to a chunk's noise), both ways; the whole-mask path, measured
    the same way, grows by the file (so the measure can see growth)."""
    peaks = {}
    for rows in (2000, 16000):
        mask = random_mask(2, rows, True, False)
        m, p = tmp_path / f"m{rows}.safetensors", tmp_path / f"p{rows}.safetensors"
        mask.save(m)
        save_padded(mask, p, 6)
        del mask
        # the lower of two runs: the first of the test also pays first-call allocations (~100 KB)
        peaks["to padded", rows] = min(_peak_above(monkeypatch, lambda each: mask_file_to_padded(
            m, tmp_path / "o.safetensors", chunk_rows=256, each=each)) for _ in range(2))
        peaks["from padded", rows] = _peak_above(monkeypatch, lambda each: padded_to_mask_file(
            p, tmp_path / "o.safetensors", chunk_rows=256, each=each))
        heap = _heap_bytes()
        start = heap()
        whole = load_padded(p)
        peaks["whole", rows] = heap() - start
        peaks["mask bytes", rows] = sum(t.nbytes for t in whole.tensors().values())
        del whole
    grown = {k: peaks[k, 16000] - peaks[k, 2000] for k in ("to padded", "from padded", "whole", "mask bytes")}
    assert grown["whole"] > 0.9 * grown["mask bytes"], grown  # the measure sees a mask held whole
    # chunked: nothing grows (MaskFile reads its offsets per chunk too, RowKey; whole they were 8 B a row)
    assert grown["to padded"] < 64 << 10, grown
    assert grown["from padded"] < 64 << 10, grown
