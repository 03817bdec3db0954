"""SamplingMask: CSR contract, conversions and files."""
import ast
import importlib
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mask_replay import MaskFormatError, SamplingMask
from mask_replay import mask as mask_module
from mask_replay.errors import DumpError
from mask_replay.mask import adapter


def sample_mask():
    return SamplingMask.from_lists(
        [[3, 1], [], [0, 2, 4], [7]],
        sampled=torch.tensor([1, 0, 4, 7]),
        logprobs=torch.tensor([-0.5, 0.0, -1.0, 0.0]),
        kept_mass=torch.tensor([0.9, 1.0, 0.8, 0.5]),
        step=torch.tensor([0, 0, 1, 1]),
    )


def test_basic_accessors():
    m = sample_mask()
    assert m.num_rows == 4 and m.nnz == 6 and len(m) == 4
    assert m.lengths().tolist() == [2, 0, 3, 1]
    assert m.row(0).tolist() == [1, 3] and m.row(1).tolist() == [] and m.row(-1).tolist() == [7]
    assert m.to_lists() == [[1, 3], [], [0, 2, 4], [7]]
    assert m.row_ids().tolist() == [0, 0, 2, 2, 2, 3]
    with pytest.raises(IndexError):
        m.row(4)
    m.validate(vocab_size=8)


@given(st.lists(st.lists(st.integers(0, 40), max_size=10), max_size=8))
def test_dense_and_list_round_trips(rows):
    m = SamplingMask.from_lists(rows)
    want = [sorted(set(r)) for r in rows]
    assert m.to_lists() == want
    dense = m.to_dense(41)
    assert dense.sum().item() == sum(len(r) for r in want)
    assert SamplingMask.from_dense(dense) == m
    m.validate(vocab_size=41)


def test_save_load_round_trip(tmp_path):
    m = sample_mask()
    m.metadata["source"] = "unit-test"
    path = tmp_path / "m.safetensors"
    m.save(path)
    back = SamplingMask.load(path)
    assert back == m
    assert back.metadata["source"] == "unit-test" and back.metadata["semantics"].startswith("mask-replay/")
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_select_rows_and_concat():
    m = sample_mask()
    a, b = m.select_rows(0, 2), m.select_rows(2, 4)
    assert a.to_lists() == [[1, 3], []] and b.to_lists() == [[0, 2, 4], [7]]
    assert SamplingMask.concat([a, b]) == m


@pytest.mark.parametrize("ids, offsets, match", [
    ([1, 2], [0, 1], r"offsets\[-1\]"),
    ([1, 2], [1, 2], r"offsets\[0\]"),
    ([1, 2, 3], [0, 2, 1, 3], "decrease at row 1"),
    ([2, 1], [0, 2], "token_ids of row 0 are not strictly ascending"),
    ([1, 1], [0, 0, 2], "token_ids of row 1 are not strictly ascending"),
    ([1, -1], [0, 1, 2], r"token_ids of row 1 hold an id outside \[0, 5\)"),
    ([1, 9], [0, 1, 2], r"token_ids of row 1 hold an id outside \[0, 5\)"),
])
def test_validate_names_the_defect(ids, offsets, match):
    m = SamplingMask(torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int64))
    with pytest.raises(MaskFormatError, match=match):
        m.validate(vocab_size=5)


def test_validate_checks_dtypes_and_extras():
    with pytest.raises(MaskFormatError, match="int32"):
        SamplingMask(torch.tensor([1]), torch.tensor([0, 1])).validate()
    m = sample_mask()
    m.sampled = torch.tensor([1, 2])
    with pytest.raises(MaskFormatError, match="sampled must have shape"):
        m.validate()
    m = sample_mask()
    m.sampled[2] = 99
    with pytest.raises(MaskFormatError, match="out of range.*row 2"):
        m.validate(vocab_size=8)


def test_load_errors_name_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    sample_mask().save(path)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpError, match="trunc.safetensors"):
        SamplingMask.load(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file at all")
    with pytest.raises(DumpError, match="junk.safetensors"):
        SamplingMask.load(tmp_path / "junk.safetensors")
    with pytest.raises(DumpError, match="no such file"):
        SamplingMask.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file({"offsets": torch.tensor([0])}, str(tmp_path / "nokey.safetensors"))
    with pytest.raises(MaskFormatError, match="missing key 'token_ids'"):
        SamplingMask.load(tmp_path / "nokey.safetensors")


def test_failed_save_leaves_nothing(tmp_path):
    m = sample_mask()
    target = tmp_path / "out.safetensors"
    with pytest.raises(Exception):
        SamplingMask(m.token_ids, m.offsets, extras={"x": object()}).save(target)
    assert not target.exists() and os.listdir(tmp_path) == []


# ---- the engine methods reach sampler/adapters/ through their registration (issue 30: no import circle) ----
@pytest.mark.parametrize("method, module, function", [
    ("from_vllm", "mask_replay.sampler.adapters.vllm", "mask_from_vllm"),
    ("from_sglang", "mask_replay.sampler.adapters.sglang", "mask_from_sglang"),
    ("from_padded", "mask_replay.sampler.adapters.padded", "mask_from_padded"),
    ("to_padded", "mask_replay.sampler.adapters.padded", "to_padded"),
])
def test_engine_methods_call_the_registered_adapter(method, module, function):
    assert mask_module._adapter(method) is getattr(importlib.import_module(module), function)
    assert getattr(SamplingMask, method).__doc__  # the public face keeps its doc


def test_engine_methods_work_and_a_second_adapter_for_one_method_is_refused():
    m = SamplingMask.from_lists([[1, 4], [2]])
    ids, counts = m.to_padded()
    assert SamplingMask.from_padded(ids, counts) == m
    with pytest.raises(RuntimeError, match="SamplingMask.to_padded already has an adapter"):
        adapter("to_padded")(lambda mask, width=None: None)


def test_mask_module_imports_no_adapter():
    tree = ast.parse(open(mask_module.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.startswith("mask_replay.sampler") for m in imported), imported


@pytest.mark.parametrize("rows, problem", [
    ([[1], [2**32 + 5]], r"from_lists: token_ids of row 1 hold an id outside \[0, 2\^31\) \(id 4294967301\)"),
    ([[-3, 1]], r"from_lists: token_ids of row 0 hold a negative id \(id -3\)"),
])
def test_from_lists_names_an_id_int32_cannot_hold(rows, problem):  # was torch's bare overflow RuntimeError
    with pytest.raises(MaskFormatError, match=problem):
        SamplingMask.from_lists(rows)
