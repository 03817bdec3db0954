"""Issue 9 §4 (byte-identical mask files) and §5 (bounded memory): the streamed safetensors writer,
the pread reader, lazy .npz members, and peak memory of capture/inspect/convert measured in a subprocess."""
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

import mask_replay
from mask_replay import SamplingMask
from mask_replay.errors import DumpError
from mask_replay.files import safetensors_stream
from mask_replay.files.padded_file import save_padded
from tests.helpers import N, assert_one_line_error, rollout_tensors, run, write

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


# ---- the writer against the reference reader ----------------------------------------------------
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def tensor_dicts(draw):
    out = {}
    for i in range(draw(st.integers(0, 6))):
        dt = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        t = (torch.arange(int(np.prod(shape, dtype=np.int64))) % 7 - 3).reshape(shape)
        out[f"k{i}_{draw(st.text('abc_', max_size=3))}"] = t.to(dt)
    return out


@given(tensors=tensor_dicts(), meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=4))
def test_written_files_read_back_with_the_reference_reader(tmp_path_factory, tensors, meta):
    path = tmp_path_factory.mktemp("w") / "x.safetensors"
    safetensors_stream.save(path, tensors, meta)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert (f.metadata() or {}) == meta
    # every tensor starts aligned to its element size, as the reference writer keeps them
    header = safetensors_stream.Header(str(path), os.open(path, os.O_RDONLY))
    for name, (dtype, _, start, _) in header.tensors.items():
        assert (header.data_start + start) % torch.empty(0, dtype=dtype).element_size() == 0, name


@given(chunks=st.lists(st.integers(0, 50), max_size=6), flag=st.booleans())
def test_streamed_file_equals_the_whole(tmp_path_factory, chunks, flag):
    """Head rows written chunk by chunk, the growing tensor appended, the tail at the end."""
    rows = len(chunks)
    ids = [torch.arange(c, dtype=torch.int32) + 1000 * i for i, c in enumerate(chunks)]
    path = tmp_path_factory.mktemp("s") / "x.safetensors"
    with open(path, "w+b") as f:
        w = safetensors_stream.StreamWriter(f, {"per_row": (torch.int64, (rows,))},
                                        growing=("ids", torch.int32, rows * 50),
                                        tail_room={"flag": (torch.bool, (rows,))}, metadata={"b": "2", "a": "1"})
        for i, t in enumerate(ids):
            w.write_rows("per_row", i, torch.tensor([len(t)]))
            w.append(t)
        w.finish({"flag": torch.ones(rows, dtype=torch.bool)} if flag else {})
    back = load_file(str(path))
    assert torch.equal(back["ids"], torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32))
    assert back["per_row"].tolist() == chunks
    assert ("flag" in back) == flag


@given(tensors=tensor_dicts(), step=st.integers(1, 4), meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                                             max_size=3))
def test_fixed_writer_by_rows_gives_the_bytes_of_save(tmp_path_factory, tensors, step, meta):
    """fixed_writer (what the chunked convert writes with): every tensor written `step` rows at a
    time, head and tail alike, in any order of the rows; the file is save()'s, byte for byte."""
    tensors = {k: (v if v.dim() else v.reshape(1)) for k, v in tensors.items()}  # rows need a first dimension
    folder = tmp_path_factory.mktemp("f")
    safetensors_stream.save(folder / "whole.safetensors", tensors, meta)
    with open(folder / "rows.safetensors", "w+b") as f:
        w = safetensors_stream.fixed_writer(f, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, meta)
        for k, v in tensors.items():
            for a in reversed(range(0, len(v), step)):
                (w.write_tail_rows if k in w.tail_room else w.write_rows)(k, a, v[a:a + step])
        w.finish()
    assert (folder / "rows.safetensors").read_bytes() == (folder / "whole.safetensors").read_bytes()


@pytest.mark.parametrize("damage", ["gap", "overlap", "short", "long", "shape"])
def test_reader_refuses_malformed_headers(tmp_path, damage):
    def file_with(entries, data_len):
        h = json.dumps(entries).encode()
        p = tmp_path / "x.safetensors"
        p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * data_len)
        return str(p)

    e = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    data_len = 12
    if damage == "gap":
        e["b"]["data_offsets"] = [12, 16]
        data_len = 16
    elif damage == "overlap":
        e["b"]["data_offsets"] = [4, 8]
    elif damage == "short":
        data_len = 11
    elif damage == "long":
        data_len = 13
    else:
        e["a"]["shape"] = [3]
    path = file_with(e, data_len)
    with pytest.raises(DumpError, match="x.safetensors"):
        safetensors_stream.Header(path, os.open(path, os.O_RDONLY))
    assert_one_line_error(run("inspect", path), "x.safetensors")


# ---- §4: identical runs, identical bytes --------------------------------------------------------
def test_capture_twice_gives_identical_bytes(tmp_path):
    path = write(tmp_path / "r.safetensors", rollout_tensors())
    outs = [tmp_path / f"m{i}.safetensors" for i in range(3)]
    for i, out in enumerate(outs):
        assert run("capture", path, "-o", out, "--chunk-rows", 5 + i).exit_code == 0
    data = [o.read_bytes() for o in outs]
    assert data[0] == data[1] == data[2]
    n = struct.unpack("<Q", data[0][:8])[0]
    meta = json.loads(data[0][8: 8 + n])["__metadata__"]
    assert list(meta) == sorted(meta)


@pytest.mark.slow
def test_mask_save_is_reproducible_across_processes(tmp_path):
    code = ("import sys, torch, mask_replay; m = mask_replay.SamplingMask.from_lists([[1, 2], [3]], "
            "sampled=torch.tensor([1, 3]), step=torch.tensor([0, 1]), metadata={f'k{i}': i for i in range(20)}); "
            "m.metadata['params'] = {'z': 1, 'a': {'y': 2, 'b': 3}}; m.save(sys.argv[1])")
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"m{seed}.safetensors"
        env = dict(ENV, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    back = SamplingMask.load(tmp_path / "m1.safetensors")
    assert back.to_lists() == [[1, 2], [3]] and json.loads(back.metadata["params"]) == {"a": {"b": 3, "y": 2}, "z": 1}


# ---- §5: streaming capture equals in-memory capture ---------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_streamed_capture_matches_the_library(tmp_path, chunk):
    t = rollout_tensors()
    t["sampled"][N - 1] = torch.argmin(t["logits"][N - 1])  # flagged in the last chunk only
    path = write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out, "--outside", "flag", "--chunk-rows", chunk).exit_code == 0
    got = SamplingMask.load(out)
    ref = mask_replay.capture(t["logits"], top_p=0.8, sampled=t["sampled"], outside="flag")
    assert torch.equal(got.token_ids, ref.token_ids) and torch.equal(got.offsets, ref.offsets)
    assert torch.equal(got.extras["outside_support"], ref.extras["outside_support"])
    assert torch.equal(got.kept_mass, ref.kept_mass) and torch.equal(got.sampled, ref.sampled)


def test_streamed_capture_of_zero_rows(tmp_path):
    t = rollout_tensors()
    t = {k: (v[:0] if v.dim() else v) for k, v in t.items()}
    path = write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    assert run("capture", path, "-o", out).exit_code == 0
    m = SamplingMask.load(out)
    assert m.num_rows == 0 and m.nnz == 0 and m.offsets.tolist() == [0]


# ---- .npz: headers only, zip bombs refused unless --force, rows streamed -----------------------
@pytest.mark.parametrize("compressed", [False, True])
def test_npz_rows_stream_in_chunks(tmp_path, compressed):
    t = rollout_tensors()
    arrays = {k: v.numpy() for k, v in t.items()}
    arrays["logits"] = np.asfortranarray(arrays["logits"]) if compressed else arrays["logits"]
    npz = tmp_path / "r.npz"
    (np.savez_compressed if compressed else np.savez)(npz, **arrays)
    ref = write(tmp_path / "r.safetensors", t)
    outs = []
    for src in (npz, ref):
        out = tmp_path / (os.path.basename(src) + ".m.safetensors")
        assert run("capture", src, "-o", out, "--chunk-rows", 5).exit_code == 0
        outs.append(SamplingMask.load(out))
    assert outs[0] == outs[1]


def test_inspect_refuses_a_zip_bomb_unless_forced(tmp_path, monkeypatch):
    import mask_replay.tools.inspect as inspect_file

    npz = tmp_path / "bomb.npz"
    np.savez_compressed(npz, logits=np.zeros((64, 1024), np.float32), sampled=np.zeros(64, np.int64))
    monkeypatch.setattr(inspect_file, "INFLATE_LIMIT", 100_000)
    assert_one_line_error(run("inspect", npz), "bomb.npz", "key 'logits'", "inflates to 262,", "--force")
    result = run("inspect", npz, "--force")
    assert result.exit_code == 0, result.output
    assert "rollout dump" in result.stdout and "[64, 1024]" in result.stdout


def _peak_rss_mb(args, env=None) -> float:
    """Peak resident memory (MB) of the CLI run in a fresh process."""
    # VmHWM, not ru_maxrss: the latter survives exec, so a child forked from a big pytest reports it
    code = ("import sys\nfrom mask_replay.cli.main import main\n"
            "try:\n    main(sys.argv[1:], prog_name='mask-replay')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]\n"
            "print('PEAK', int(hwm.split()[1]) / 1024)")
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=env or ENV)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split("PEAK")[-1])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--entry-logprobs",)])
def test_capture_and_score_memory_is_bounded_by_the_chunk(tmp_path, extra):
    """256 MB of flat fp32 rows at top-p .95 make a ~250 MB mask; capture and score in chunks of 64
    rows (8 MB) must stay far below either size (before streaming, capture held the dump's pages,
    the whole mask and its concatenation: ~700 MB over the baseline; score the whole mask). With
    --entry-logprobs the mask has as many float32 log-probs again, streamed the same way."""
    rows, vocab = 2048, 32768
    g = torch.Generator().manual_seed(0)
    logits = torch.rand(rows, vocab, generator=g) * 0.01
    big = tmp_path / "flat.safetensors"
    safetensors_stream.save(big, {"logits": logits, "sampled": logits.argmax(1)})
    del logits
    small = tmp_path / "small.safetensors"
    safetensors_stream.save(small, {"logits": torch.zeros(64, vocab), "sampled": torch.zeros(64, dtype=torch.int64)})
    # With entry log-probs each chunk makes float64 temporaries of ~16 MB (2M entries); glibc raises its
    # mmap threshold past such sizes once they are freed, so later ones come from the heap and
    # fragment it (~130 MB more peak here, not growing with the data retained: none is). A fixed
    # threshold shows what capture itself holds.
    env = dict(ENV, MALLOC_MMAP_THRESHOLD_="131072") if extra else None
    base = _peak_rss_mb(["capture", small, "-o", tmp_path / "s.m", "--top-p", "0.95", "--chunk-rows", 64, *extra], env)
    peak = _peak_rss_mb(["capture", big, "-o", tmp_path / "b.m", "--top-p", "0.95", "--chunk-rows", 64, *extra], env)
    m = SamplingMask.load(tmp_path / "b.m", validate=False)
    assert m.nnz * 4 > 200e6  # the mask really is large
    assert (m.entry_logprobs is not None) == bool(extra)
    del m
    assert peak - base < 100, (peak, base)
    # score reads the mask's ids chunk by chunk too (it used to load the whole mask file)
    base = _peak_rss_mb(["score", "--masks", tmp_path / "s.m", "--training", small, "--chunk-rows", 64], env)
    peak = _peak_rss_mb(["score", "--masks", tmp_path / "b.m", "--training", big, "--chunk-rows", 64], env)
    assert peak - base < 100, (peak, base)


@pytest.mark.slow
def test_inspect_memory_does_not_inflate_npz(tmp_path):
    npz = tmp_path / "zeros.npz"
    np.savez_compressed(npz, logits=np.zeros((2048, 32768), np.float32), sampled=np.zeros(2048, np.int64))
    small = tmp_path / "small.npz"
    np.savez_compressed(small, logits=np.zeros((4, 8), np.float32), sampled=np.zeros(4, np.int64))
    base = _peak_rss_mb(["inspect", small])
    peak = _peak_rss_mb(["inspect", npz])
    assert peak - base < 30, (peak, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_streamed_rows_equal_copied_rows_and_stay_valid(tmp_path, dtype):
    from mask_replay.files.dumps import Dump

    x = (torch.arange(37 * 5) % 11).reshape(37, 5).to(dtype)
    path = tmp_path / "x.safetensors"
    safetensors_stream.save(path, {"x": x, "odd": torch.zeros(3, dtype=torch.int8)})
    with Dump(path) as d:
        first = d.get("x", 0, 8, stream=True)
        for a in range(0, 40, 8):
            got = d.get("x", a, a + 8, stream=True)
            assert torch.equal(got, d.get("x", a, a + 8)) and torch.equal(got, x[a: a + 8])
        # a released chunk is only unmapped from this process: reading it again reads the file
        assert torch.equal(first, x[:8])
        assert d.get("x", 50, 60, stream=True).shape == (0, 5)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["from padded", "to padded"])
def test_convert_memory_is_bounded_by_the_chunk(tmp_path, direction):
    """convert between a ~60 MB padded file and its mask file in chunks of 4096 rows: the peak over
    a 64-row file's stays under half the file's size (whole, it was 4.5-6x: docs/benchmarks.md)."""
    def mask_of(rows):  # 8 ascending ids a row, uniform entry log-probs
        g = torch.Generator().manual_seed(0)
        ids = (torch.randint(0, 100, (rows, 1), generator=g) + torch.arange(8) * 1000).reshape(-1)
        return SamplingMask(ids.to(torch.int32), torch.arange(rows + 1) * 8,
                            entry_logprobs=torch.full((rows * 8,), -math.log(8.0)))

    sizes = {}
    for name, rows in (("small", 64), ("big", 850_000)):
        mask = mask_of(rows)
        mask.save(tmp_path / f"{name}.m")
        save_padded(mask, tmp_path / f"{name}.p")
        del mask
        src = tmp_path / (f"{name}.p" if direction == "from padded" else f"{name}.m")
        flags = ["--from", "padded"] if direction == "from padded" else ["--from", "mask", "--to", "padded"]
        sizes[name] = _peak_rss_mb(["convert", src, "-o", tmp_path / "out", *flags, "--chunk-rows", 4096])
    file_mb = os.path.getsize(tmp_path / ("big.p" if direction == "from padded" else "big.m")) / 2**20
    assert file_mb > 50
    assert sizes["big"] - sizes["small"] < file_mb / 2, (sizes, file_mb)
