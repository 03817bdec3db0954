"""Hand-crafted hostile mask files (issue 30): a header that names a key twice, declares shapes that
lie (a per-row key of GBs in a 24-row file), or keys of the wrong dtype / shape, and files that are
folders, empty or unopenable. SamplingMask.load, MaskFile (what score reads), `inspect` and `score`
each refuse them with one error naming the file and the key, the header checked before anything
is read, and nothing written. (Offsets, ids and row values are covered in tests/cli/test_errors.py,
tests/tools/test_impossible_values.py and tests/tools/test_entry_logprobs.py.)"""
import json
import os
import struct
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from mask_replay import SamplingMask
from mask_replay.csr import check_offsets, check_row_values
from mask_replay.errors import DumpError, MaskFormatError
from mask_replay.files import mask_file, safetensors_stream
from mask_replay.files.dumps import Dump
from mask_replay.files.mask_file import MaskFile
from tests.helpers import N, V, assert_one_line_error, rollout_tensors, run, write

CODES = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


@pytest.fixture
def base(tmp_path):
    """(tensors, metadata) of a captured mask file with entry_logprobs, and the training dump to score it."""
    rollout = write(tmp_path / "r.safetensors", rollout_tensors())
    write(tmp_path / "train.safetensors", {"logits": rollout_tensors()["logits"]})
    assert run("capture", rollout, "-o", tmp_path / "m.safetensors", "--entry-logprobs").exit_code == 0
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def safetensors_bytes(tensors, metadata, *, extra=None, text=None):
    """A safetensors file written by hand: `extra` {key: (code, shape, nbytes)} are entries declared
    after the real data with no bytes behind them (the file is extended sparse to match); `text`
    rewrites the JSON header (to repeat a key, which no JSON writer does)."""
    header, blobs, pos = {"__metadata__": dict(metadata)}, [], 0
    for k, v in tensors.items():
        b = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
        header[k] = {"dtype": CODES[v.dtype], "shape": list(v.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    for k, (code, shape, nbytes) in (extra or {}).items():
        header[k] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header).encode()
    if text is not None:
        raw = text(raw.decode()).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs), 8 + len(raw) + pos


def hostile(path, tensors, metadata, **kw):
    data, size = safetensors_bytes(tensors, metadata, **kw)
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(size)  # sparse: a declared GB costs no disk
    return str(path)


def repeat(key, entry):
    """Header text with `key` named once more, first, holding `entry`."""
    return lambda text: text.replace(f'"{key}":', f'"{key}": {json.dumps(entry)}, "{key}":', 1)


def with_key(tensors, key, value):
    out = dict(tensors)
    if value is None:
        out.pop(key, None)
    else:
        out[key] = value
    return out


def refused_everywhere(tmp_path, path, *needles, cls=DumpError, score_needles=None):
    """load, MaskFile, inspect and score all refuse `path` with `needles` (score with `score_needles`
    when given); score's --json is untouched."""
    with pytest.raises(cls) as info:
        SamplingMask.load(path)
    assert all(n in str(info.value) for n in needles), str(info.value)
    with pytest.raises(cls) as info:
        with MaskFile(path) as mf:
            mf.rows(0, mf.num_rows, V)
    assert all(n in str(info.value) for n in needles), str(info.value)
    assert_one_line_error(run("inspect", path), *needles)
    report = tmp_path / "score.json"
    report.write_text("earlier report")
    result = run("score", "--masks", path, "--training", tmp_path / "train.safetensors", "--json", report)
    assert_one_line_error(result, *(needles if score_needles is None else score_needles))
    assert report.read_text() == "earlier report"


# ---- a key named twice: readers disagree on which one counts ------------------------------------
@pytest.mark.parametrize("key, entry", [
    ("offsets", {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}),
    ("entry_logprobs", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}),
    ("__metadata__", {"vocab_size": "5"}),
    ("semantics", "other"),  # inside __metadata__
    ("dtype", "I64"),  # inside an entry
])
def test_a_header_naming_a_key_twice_is_refused(tmp_path, base, key, entry):
    tensors, meta = base
    path = hostile(tmp_path / "dup.safetensors", tensors, meta, text=repeat(key, entry))
    refused_everywhere(tmp_path, path, "dup.safetensors", f"names '{key}' twice")


def test_the_reference_reader_keeps_the_last_of_two_entries(tmp_path, base):
    """Why the check exists: the same bytes are read as a different mask once a repeated entry is
    accepted (here an empty entry_logprobs first: the reference reader silently keeps the last)."""
    tensors, meta = base
    path = hostile(tmp_path / "dup.safetensors", tensors, meta,
                   text=repeat("entry_logprobs", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}))
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("entry_logprobs").shape == tensors["entry_logprobs"].shape


# ---- shapes that lie: refused from the header, before a byte of the key is read -----------------
@pytest.mark.parametrize("key, code, elements", [
    ("kept_mass", "F32", 1 << 28),  # 1 GiB declared for a 24-row file
    ("step", "I64", 1 << 27),
    ("notes", "F32", 1 << 28),  # an extra per-row key of no documented name
    ("entry_logprobs", "F32", 1 << 28),
])
def test_a_per_row_key_declaring_gigabytes_is_refused_before_it_is_read(tmp_path, base, monkeypatch, key, code,
                                                                        elements):
    tensors, meta = base
    path = hostile(tmp_path / "big.safetensors", with_key(tensors, key, None), meta,
                   extra={key: (code, [elements], elements * (4 if code == "F32" else 8))})
    real_get = Dump.get

    def get(self, k, *args, **kwargs):  # the refusal must come from the header, not after reading it
        assert k != key, f"{k} was read before its shape was checked"
        return real_get(self, k, *args, **kwargs)

    monkeypatch.setattr(Dump, "get", get)
    refused_everywhere(tmp_path, path, "big.safetensors", key, str(elements))


# ---- keys of the wrong dtype or shape: the same words from every reader ------------------------
@pytest.mark.parametrize("key, value, needle", [
    ("token_ids", lambda t: t.long(), "key 'token_ids': must be a 1-D int32 tensor, got int64"),
    ("token_ids", lambda t: t.float(), "key 'token_ids': must be a 1-D int32 tensor, got float32"),
    ("token_ids", lambda t: t[None], "key 'token_ids': must be a 1-D int32 tensor, got int32 [1, "),
    ("offsets", lambda t: t.int(), "key 'offsets': must be a 1-D int64 tensor"),
    ("entry_logprobs", lambda t: t[:, None], "key 'entry_logprobs': must be a 1-D float tensor of"),
    ("entry_logprobs", lambda t: t[:-1], "key 'entry_logprobs': must be a 1-D float tensor of"),
    ("entry_logprobs", lambda t: t.long(), "key 'entry_logprobs': must be a float tensor, got int64"),
    ("kept_mass", lambda t: t[:, None], "kept_mass must have shape [24], got (24, 1)"),
    ("step", lambda t: t[:-1], "step must have shape [24], got (23,)"),
    ("sampled", lambda t: t.float(), "key 'sampled': must be an integer tensor, got float32"),
])
def test_keys_of_the_wrong_dtype_or_shape(tmp_path, base, key, value, needle):
    tensors, meta = base
    path = hostile(tmp_path / "bad.safetensors", with_key(tensors, key, value(tensors[key])), meta)
    refused_everywhere(tmp_path, path, "bad.safetensors", needle, cls=DumpError)


@pytest.mark.parametrize("key", ["token_ids", "offsets"])
def test_a_mask_file_missing_its_ids_or_offsets(tmp_path, base, key):
    tensors, meta = base
    path = hostile(tmp_path / "half.safetensors", with_key(tensors, key, None), meta)
    refused_everywhere(tmp_path, path, "half.safetensors", f"missing key '{key}' (is this a mask file?)",
                       cls=DumpError)


# ---- a header whose byte ranges lie about the data behind them ----------------------------------
def _shift(key, by):
    def patch(text):
        header = json.loads(text)
        header[key]["data_offsets"] = [o + by for o in header[key]["data_offsets"]]
        return json.dumps(header)
    return patch


def _onto(key, other):
    def patch(text):
        header = json.loads(text)
        header[key]["data_offsets"] = header[other]["data_offsets"]
        return json.dumps(header)
    return patch


@pytest.mark.parametrize("damage, needle", [
    ("entry_logprobs past the end", "overlap or leave a gap"),
    ("entry_logprobs over token_ids", "overlap or leave a gap"),
    ("truncated by 3 bytes", "the header says"),
])
def test_byte_ranges_that_lie(tmp_path, base, damage, needle):
    tensors, meta = base
    path = tmp_path / "lie.safetensors"
    if damage == "entry_logprobs past the end":
        hostile(path, tensors, meta, text=_shift("entry_logprobs", 1 << 20))
    elif damage == "entry_logprobs over token_ids":
        hostile(path, tensors, meta, text=_onto("entry_logprobs", "token_ids"))
    else:
        data, _ = safetensors_bytes(tensors, meta)
        path.write_bytes(data[:-3])
    refused_everywhere(tmp_path, str(path), "lie.safetensors", needle)


# ---- not a file one can read ---------------------------------------------------------------------
def test_a_folder_an_empty_file_and_an_unopenable_file(tmp_path, base, monkeypatch):
    (tmp_path / "dir.safetensors").mkdir()
    # score hashes its inputs first (files/identity.py), which says it in the OS's words
    refused_everywhere(tmp_path, str(tmp_path / "dir.safetensors"), "dir.safetensors", "is a folder",
                       score_needles=("dir.safetensors", "Is a directory"))
    (tmp_path / "empty.safetensors").write_bytes(b"")
    refused_everywhere(tmp_path, str(tmp_path / "empty.safetensors"), "empty.safetensors", "too short")
    path = write(tmp_path / "locked.safetensors", base[0])
    real_open = os.open

    def denied(p, *args, **kwargs):  # the suite may run as root, where chmod 000 still reads
        if os.fspath(p) == path:
            raise PermissionError(13, "Permission denied", path)
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(DumpError, match="locked.safetensors: cannot be opened"):
        SamplingMask.load(path)
    with pytest.raises(DumpError, match="locked.safetensors.*Permission denied"):
        MaskFile(path)
    assert_one_line_error(run("inspect", path), "locked.safetensors", "Permission denied")


def test_a_valid_file_with_entry_logprobs_still_reads_everywhere(tmp_path, base):
    tensors, meta = base
    path = hostile(tmp_path / "ok.safetensors", tensors, meta)
    mask = SamplingMask.load(path)
    assert torch.equal(mask.entry_logprobs, tensors["entry_logprobs"])
    with MaskFile(path) as mf:
        rows = mf.rows(0, mf.num_rows, V)
        assert torch.equal(rows.token_ids, mask.token_ids) and torch.equal(rows.entry_logprobs, mask.entry_logprobs)
    assert run("inspect", path).exit_code == 0
    assert run("score", "--masks", path, "--training", tmp_path / "train.safetensors").exit_code == 0


# ---- per-row keys read a chunk at a time (RowKey), checked block by block at open ----------------
def _row_keys(mf):
    named = {k: getattr(mf, k) for k in ("offsets", "sampled", "logprobs", "kept_mass")}
    return {**{k: v for k, v in named.items() if v is not None}, **mf.extras}


@pytest.mark.parametrize("block", [1, 7, None])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_streamed_per_row_reads_equal_the_whole_file(tmp_path, base, monkeypatch, chunk, block):
    """Every per-row key read in chunks of 1, 7 or all rows (and in the check blocks, of 1, 7 or
    CHECK_BLOCK rows) is the whole key as safetensors reads it, and rows(a, b) are its ids."""
    if block is not None:
        monkeypatch.setattr(mask_file, "CHECK_BLOCK", block)
    tensors, meta = base
    path = hostile(tmp_path / "ok.safetensors", tensors, meta)
    with MaskFile(path) as mf:
        keys = _row_keys(mf)
        assert set(keys) == set(tensors) - {"token_ids", "entry_logprobs"}
        n = mf.num_rows
        step = chunk or n
        for name, key in keys.items():
            want = tensors[name]
            assert key.shape == tuple(want.shape) and key.dtype == want.dtype and key.numel() == want.numel()
            extra = int(name == "offsets")  # a chunk [a, b) of offsets holds b - a + 1 values
            rows = want.shape[0] - extra
            parts = [key[a: min(a + step, rows) + extra] for a in range(0, rows, step)]
            assert torch.equal(torch.cat([p if i == 0 else p[extra:] for i, p in enumerate(parts)]), want), name
            assert torch.equal(key.whole(), want) and torch.equal(key[-1], want[-1]) and torch.equal(key[3], want[3])
            blocks = list(key.blocks(overlap=extra))
            assert [a for a, _ in blocks] == list(range(0, rows, block or mask_file.CHECK_BLOCK))
            joined = torch.cat([b if a == 0 else b[extra:] for a, b in blocks])
            assert torch.equal(joined, want), name
        ids = torch.cat([mf.rows(a, min(a + step, n), V).token_ids.clone() for a in range(0, n, step)])
        assert torch.equal(ids, tensors["token_ids"])
        with pytest.raises(IndexError):
            keys["sampled"][::2]
        with pytest.raises(IndexError):
            keys["sampled"][n]


def _damaged(tensors, key, row, value):
    out = {k: v.clone() for k, v in tensors.items()}
    out[key][row] = out[key][row - 1] - 1 if value == "just below offsets[13]" else value
    return out


@pytest.mark.parametrize("key, row, value, needle", [
    ("offsets", 7, -1, "offsets decrease at row 6 "),  # across the first block's end
    ("offsets", 14, "just below offsets[13]", "offsets decrease at row 13 "),  # offsets 13 and 14 in two blocks
    ("offsets", 21, 1, "offsets decrease at row 20 "),  # in the last block
    ("offsets", N, 10 ** 6, "offsets[-1] = 1000000 but token_ids has"),
    ("logprobs", 22, 0.5, "row 22 has logprobs 0.5"),
    ("kept_mass", 15, 1.5, "row 15 has kept_mass 1.5"),
    ("capture_logprobs", 23, 2.0, "row 23 has capture_logprobs 2"),
])
def test_a_bad_value_in_a_late_block_is_refused_with_its_row(tmp_path, base, monkeypatch, key, row, value, needle):
    """With check blocks of 7 rows, a bad offset or impossible value in a later block is refused at
    open in the words and row of the whole-file check, by MaskFile, score and convert (and load and
    inspect), with nothing written."""
    monkeypatch.setattr(mask_file, "CHECK_BLOCK", 7)
    tensors, meta = base
    bad = _damaged(tensors, key, row, value)
    with pytest.raises(MaskFormatError) as whole:  # the checks on the whole keys, as before
        check_offsets(bad["offsets"], bad["token_ids"].numel(), source="f")
        check_row_values({k: bad[k] for k in ("logprobs", "kept_mass", "capture_logprobs")}, source="f")
    path = hostile(tmp_path / "bad.safetensors", bad, meta)
    with pytest.raises(MaskFormatError) as info:
        MaskFile(path)
    assert str(info.value) == str(whole.value).replace("f:", f"{path}:", 1)
    assert needle in str(info.value)
    if key != "capture_logprobs":  # SamplingMask.load (and so inspect) does not check that key
        refused_everywhere(tmp_path, path, str(info.value))
    report = tmp_path / "score.json"
    report.write_text("earlier report")
    result = run("score", "--masks", path, "--training", tmp_path / "train.safetensors", "--json", report)
    assert_one_line_error(result, str(info.value))
    assert report.read_text() == "earlier report"
    out = tmp_path / "p.safetensors"
    assert_one_line_error(run("convert", path, "-o", out, "--from", "mask", "--to", "padded"), str(info.value))
    assert not out.exists()


def test_of_two_bad_keys_the_first_checked_is_named(tmp_path, base, monkeypatch):
    """logprobs are checked before kept_mass, block by block: a bad logprob in the last block is
    named, not a bad kept mass in the first (the order of the whole-key checks)."""
    monkeypatch.setattr(mask_file, "CHECK_BLOCK", 7)
    tensors, meta = base
    bad = _damaged(_damaged(tensors, "logprobs", 22, 0.5), "kept_mass", 1, -3.0)
    with pytest.raises(MaskFormatError, match="row 22 has logprobs 0.5"):
        MaskFile(hostile(tmp_path / "bad.safetensors", bad, meta))


def test_a_bad_temperature_in_a_late_block_is_refused_by_score(tmp_path, base, monkeypatch):
    monkeypatch.setattr(mask_file, "CHECK_BLOCK", 7)
    tensors, meta = base
    path = hostile(tmp_path / "bad.safetensors", _damaged(tensors, "temperature", 20, float("nan")), meta)
    report = tmp_path / "score.json"
    report.write_text("earlier report")
    result = run("score", "--masks", path, "--training", tmp_path / "train.safetensors", "--json", report)
    assert_one_line_error(result, "bad.safetensors", "temperature", "nan is not a finite value >= 0 at row 20")
    assert report.read_text() == "earlier report"


# a check block size, and the offset to damage: none, any, or one that starts a block (the checks'
# seams)
_BLOCK_AND_DROP = st.integers(1, 9).flatmap(lambda block: st.tuples(st.just(block), st.one_of(
    st.none(), st.integers(0, 30), st.integers(1, 4).map(lambda k: k * block))))


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 3), min_size=0, max_size=30), block_drop=_BLOCK_AND_DROP,
       high=st.one_of(st.none(), st.integers(0, 29)), cuts=st.lists(st.integers(0, 30), max_size=6))
def test_block_checks_and_chunk_reads_match_the_whole_file(lengths, block_drop, high, cuts):
    """Any row lengths, check blocks and chunk cuts: MaskFile refuses exactly when the whole-key
    checks do, with their message (offset `drop` below the one before, a log-prob > 0 at row `high`),
    and the chunks it reads of a good file join into the whole keys."""
    block, drop = block_drop
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(mask_file, "CHECK_BLOCK", block)
        _compare_with_the_whole_file(lengths, drop, high, cuts)


def _compare_with_the_whole_file(lengths, drop, high, cuts):
    n = len(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64).cumsum(0)])
    ids = torch.cat([torch.arange(k, dtype=torch.int32) for k in lengths] + [torch.zeros(0, dtype=torch.int32)])
    tensors = {"token_ids": ids, "offsets": offsets,
               "logprobs": -torch.arange(n, dtype=torch.float32), "temperature": torch.ones(n)}
    if drop is not None and drop <= n:  # below the offset before it (offsets[0] below 0)
        offsets[drop] -= 1 + (lengths[drop - 1] if drop else 0)
    if high is not None and high < n:
        tensors["logprobs"][high] = 0.5
    with tempfile.TemporaryDirectory() as folder:
        path = write(os.path.join(folder, "m.safetensors"), tensors)
        try:
            check_offsets(offsets, tensors["token_ids"].numel(), source=path)
            check_row_values({"logprobs": tensors["logprobs"]}, source=path)
            want = None
        except MaskFormatError as exc:
            want = str(exc)
        if want is not None:
            with pytest.raises(MaskFormatError) as info:
                MaskFile(path)
            assert str(info.value) == want
            return
        with MaskFile(path) as mf:
            bounds = sorted({0, n, *(c for c in cuts if c <= n)})
            for name, key in _row_keys(mf).items():
                extra = int(name == "offsets")
                parts = [key[a: b + extra] for a, b in zip(bounds, bounds[1:])] or [key[0: extra]]
                got = torch.cat([p if i == 0 else p[extra:] for i, p in enumerate(parts)])
                assert torch.equal(got, tensors[name]), name
            # each chunk's ids are a view of the file map, unmapped when the next chunk is read: copied
            got = [mf.rows(a, b, 4).token_ids.clone() for a, b in zip(bounds, bounds[1:])] or [ids[:0]]
            assert torch.equal(torch.cat(got), ids)


def test_another_format_version_is_refused_by_every_reader(tmp_path):
    mask = SamplingMask.from_lists([[1, 2], [3]])
    meta = dict(mask_file.file_metadata(mask.metadata), format_version="2")
    path = tmp_path / "future.safetensors"
    safetensors_stream.save(path, mask.tensors(), meta)
    for read in (SamplingMask.load, MaskFile):
        with pytest.raises(MaskFormatError, match=r"future\.safetensors: format_version '2': this mask_replay .* reads "
                                                  r"format_version '1'"):
            read(str(path))
