"""An engine batch is the rows an engine sampled in one step: the dump's `batch` key (rows with one
value), or the whole dump. The engine profiles' batch-wide choices (vLLM's top-p pass, SGLang's
plain-softmax branch and topk-or-sort) are made per engine batch, so masks and score reports are
bit-identical whatever the chunk size and however the rows are shared among ranks."""
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import mask_replay as mr
from mask_replay.tools.capture import capture_dumps
from mask_replay.tools.launch import share
from mask_replay.tools.torchrun import merge_masks
from tests.helpers import run, torchrun

PROFILES = ("exact", "vllm", "sglang", "hf")


def _issue_dump(path):
    """The issue's example: rows 0-1 top_p 1.0, rows 2-3 top_p 0.9, half of each row at -200."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 128, generator=g)
    z[:, 64:] = -200.0
    save_file({"logits": z, "sampled": z.argmax(1), "top_p": torch.tensor([1.0, 1.0, 0.9, 0.9])}, str(path))
    return str(path)


def _tied_greedy_dump(path):
    """SGLang: a greedy row whose maximum is tied, beside rows with and without top-k."""
    z = torch.zeros(4, 16)
    z[:, 3] = z[:, 9] = 5.0  # two tied maxima in every row
    z[:, 5] = 1.0
    save_file({"logits": z, "sampled": torch.tensor([3, 3, 3, 3]), "temperature": torch.tensor([0.0, 1.0, 0.0, 1.0]),
               "top_k": torch.tensor([0, 0, 0, 2])}, str(path))
    return str(path)


def _capture(path, profile, **kw):
    return capture_dumps([path], None, profile=profile, progress=False, outside="flag", **kw).mask


def _ranks(path, profile, world, n):
    return merge_masks([_capture(path, profile, rows=share(n, world, r)) for r in range(world)], "flag")


@pytest.mark.parametrize("profile", PROFILES)
def test_issue_example_is_the_same_for_every_chunking(tmp_path, profile):
    path = _issue_dump(tmp_path / "r.safetensors")
    whole = _capture(path, profile)
    for chunk in (1, 2, 3):
        assert _capture(path, profile, chunk_rows=chunk) == whole
    for world in (2, 3):
        assert _ranks(path, profile, world, 4) == whole
    if profile == "vllm":  # the top-p pass runs for rows 0-1 too: their -200 tail underflows, is dropped
        assert whole.lengths().tolist()[:2] == [64, 64]


def test_sglang_tied_greedy_row_does_not_depend_on_its_chunk(tmp_path):
    path = _tied_greedy_dump(tmp_path / "r.safetensors")
    whole = _capture(path, "sglang")
    for chunk in (1, 2, 3):
        assert _capture(path, "sglang", chunk_rows=chunk) == whole
    one = mr.capture(_logits(path), profile="sglang", temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]),
                     top_k=torch.tensor([0, 0, 0, 2]))
    assert one.to_lists() == whole.to_lists()
    assert "outside_support" not in whole.extras  # the sampled first tied id is kept in every row


def _logits(path):
    return load_file(path)["logits"]


@st.composite
def dumps(draw):
    n = draw(st.integers(1, 9))
    v = draw(st.integers(2, 24))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-3, 4, (n, v), generator=g).float()  # many ties
    z[:, v // 2:] += -200.0 * torch.randint(0, 2, (n, 1), generator=g).float()  # some rows with an underflowing tail
    tensors = {
        "logits": z, "sampled": z.argmax(1),
        "temperature": torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.7, 1.0]), min_size=n, max_size=n))),
        "top_p": torch.tensor(draw(st.lists(st.sampled_from([1.0, 0.9, 0.5]), min_size=n, max_size=n))),
        "top_k": torch.tensor(draw(st.lists(st.sampled_from([0, 1, 3, v + 2]), min_size=n, max_size=n))),
    }
    if draw(st.booleans()):
        tensors["batch"] = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    return tensors


@pytest.mark.slow  # seconds: kept out of the fast loop, run by make test
@settings(max_examples=25, deadline=None)
@given(tensors=dumps(), profile=st.sampled_from(PROFILES), chunk=st.integers(1, 4))
def test_masks_do_not_depend_on_chunks_or_ranks(tmp_path_factory, tensors, profile, chunk):
    path = str(tmp_path_factory.mktemp("eb") / "r.safetensors")
    save_file(tensors, path)
    n = tensors["logits"].shape[0]
    whole = _capture(path, profile)
    assert _capture(path, profile, chunk_rows=chunk) == whole
    for world in (2, 3):
        assert _ranks(path, profile, world, n) == whole
    # the engine batch, in one call of the API: the same supports
    api = mr.capture(tensors["logits"], temperature=tensors["temperature"], top_k=tensors["top_k"],
                     top_p=tensors["top_p"], profile=profile, batch=tensors.get("batch"))
    assert api.to_lists() == whole.to_lists()


def test_batch_key_splits_the_engine_batches(tmp_path):
    """The issue's rows as two engine batches (0-1 and 2-3): rows 0-1 have no top-p pass, keep all."""
    path = _issue_dump(tmp_path / "r.safetensors")
    tensors = load_file(path)
    tensors["batch"] = torch.tensor([0, 0, 1, 1])
    save_file(tensors, str(tmp_path / "b.safetensors"))
    mask = _capture(str(tmp_path / "b.safetensors"), "vllm", chunk_rows=3)
    assert mask.lengths().tolist()[:2] == [128, 128]


def test_score_report_does_not_depend_on_chunks(tmp_path):
    path = _issue_dump(tmp_path / "r.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({"logits": _logits(path) + 0.1 * torch.randn(4, 128, generator=g)}, str(tmp_path / "t.safetensors"))
    reports = []
    for chunk in (1, 3, 4):
        masks, js = tmp_path / f"m{chunk}.safetensors", tmp_path / f"s{chunk}.json"
        assert run("capture", path, "-o", masks, "--profile", "vllm", "--chunk-rows", chunk).exit_code == 0
        result = run("score", "--masks", masks, "--training", tmp_path / "t.safetensors", "--json", js,
                     "--chunk-rows", chunk)
        assert result.exit_code == 0, result.output
        report = json.loads(js.read_text())
        assert report.pop("inputs")["masks"]["path"].endswith(f"m{chunk}.safetensors")  # each its own file
        reports.append(report)
    assert reports[0] == reports[1] == reports[2]


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["vllm", "sglang"])
def test_torchrun_ranks_write_the_single_process_mask(tmp_path, profile):
    make = _issue_dump if profile == "vllm" else _tied_greedy_dump
    path = make(tmp_path / "r.safetensors")
    assert run("capture", path, "-o", tmp_path / "one.safetensors", "--profile", profile).exit_code == 0
    for world in (2, 3):
        out = tmp_path / f"w{world}.safetensors"
        proc = torchrun(world, "-m", "mask_replay", "capture", path, "-o", out, "--profile", profile, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert mr.SamplingMask.load(str(out)) == mr.SamplingMask.load(str(tmp_path / "one.safetensors"))
    assert os.path.exists(tmp_path / "one.safetensors")


def _split_and_whole(tmp_path, tensors, cut):
    save_file(tensors, str(tmp_path / "whole.safetensors"))
    for name, rows in (("a", slice(0, cut)), ("b", slice(cut, None))):
        save_file({k: v[rows].contiguous() if v.dim() else v for k, v in tensors.items()},
                  str(tmp_path / f"{name}.safetensors"))
    return [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")], str(tmp_path / "whole.safetensors")


@pytest.mark.parametrize("profile", PROFILES)
def test_batch_ids_are_global_across_input_files(tmp_path, profile):
    """Regression: the batch-wide switches were decided per input file, so the same rows and batch
    ids split over two dumps gave other masks than one dump (silently). Batch 0 has rows in both
    files; only its row in the second file has top_p < 1."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, 128, generator=g)
    z[:, 64:] = -200.0
    tensors = {"logits": z, "sampled": z.argmax(1), "top_p": torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0]),
               "batch": torch.tensor([0, 0, 1, 0, 1, 2])}
    parts, whole = _split_and_whole(tmp_path, tensors, 3)
    one = _capture(whole, profile)
    two = capture_dumps(parts, None, profile=profile, progress=False, outside="flag").mask
    assert two == one
    for chunk in (1, 4):  # and ranks whose shares cross the file boundary
        assert capture_dumps(parts, None, profile=profile, progress=False, outside="flag", chunk_rows=chunk).mask == one
    assert merge_masks([capture_dumps(parts, None, profile=profile, progress=False, outside="flag",
                                      rows=share(6, 4, r)).mask for r in range(4)], "flag") == one
    if profile == "vllm":  # rows 0-1 (file a) share batch 0 with row 3 (file b): the top-p pass drops their tail
        assert one.lengths().tolist()[:2] == [64, 64]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 9), data=st.data())
def test_several_files_capture_as_their_concatenation(tmp_path_factory, seed, n, data):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 32, generator=g) * 3
    z[:, 16:] -= 150.0
    tensors = {"logits": z, "sampled": z.argmax(1),
               "top_p": torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 0.8, 0.95]), min_size=n, max_size=n))),
               "top_k": torch.tensor(data.draw(st.lists(st.sampled_from([0, 3, 40]), min_size=n, max_size=n))),
               "batch": torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))}
    parts, whole = _split_and_whole(tmp_path_factory.mktemp("split"), tensors, data.draw(st.integers(1, n - 1)))
    for profile in ("vllm", "sglang"):
        assert capture_dumps(parts, None, profile=profile, progress=False, outside="flag").mask == \
            _capture(whole, profile)


def test_batch_key_in_some_input_files_only_is_refused(tmp_path):
    tensors = {"logits": torch.randn(4, 16), "sampled": torch.zeros(4, dtype=torch.int64),
               "batch": torch.tensor([0, 0, 1, 1])}
    parts, _ = _split_and_whole(tmp_path, tensors, 2)
    t = load_file(parts[1])
    t.pop("batch")
    save_file(t, parts[1])
    out = tmp_path / "m.safetensors"
    result = run("capture", *parts, "-o", out, "--profile", "vllm")
    assert result.exit_code != 0 and result.output.count("\n") == 1, result.output
    assert "b.safetensors" in result.output and "'batch'" in result.output and "global" in result.output
    assert not out.exists()
