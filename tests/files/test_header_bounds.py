"""Header values are checked as Python integers with a bound: a declared shape whose element count
wraps numpy's int64 product, or exceeds any disk, is refused at open with one line; so are JSON
floats, bools or negatives where the format wants counts, and __metadata__ values that are not strings
(the reference safetensors reader refuses them too)."""
import io
import json
import re
import struct
import zipfile

import numpy as np
import pytest

from mask_replay.errors import DumpError
from mask_replay.files.dumps import Dump
from tests.helpers import assert_one_line_error, run

EMPTY = {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}


def _safetensors(path, header):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


@pytest.mark.parametrize("entry, needle", [
    ({"dtype": "F32", "shape": [8, 2 ** 61], "data_offsets": [0, 0]}, "more than 2^48 elements"),
    ({"dtype": "F32", "shape": [2 ** 32, 2 ** 32], "data_offsets": [0, 0]}, "more than 2^48 elements"),
    ({"dtype": "F32", "shape": [0, 2 ** 61], "data_offsets": [0, 0]}, "more than 2^48 elements"),
    ({"dtype": "F32", "shape": [0, 4.0], "data_offsets": [0, 0]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [True, 1], "data_offsets": [0, 4]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [-1, 1], "data_offsets": [0, 0]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [0, 4], "data_offsets": [0.0, 0]}, "malformed safetensors header entry"),
    ({"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0, 0]}, "malformed safetensors header entry"),
])
def test_safetensors_header_shapes_and_offsets(tmp_path, entry, needle):
    path = _safetensors(tmp_path / "d.safetensors", {"logits": entry})
    with pytest.raises(DumpError, match=re.escape(needle)):
        Dump(path)
    assert_one_line_error(run("inspect", path), "key 'logits'", needle)
    assert_one_line_error(run("score", "--masks", path, "--training", path), needle)


@pytest.mark.parametrize("metadata, needle", [
    ({"vocab_size": [32]}, "__metadata__ 'vocab_size' is a JSON list"),
    ({"sources": ["a.safetensors"]}, "__metadata__ 'sources' is a JSON list"),
    ({"n": 3}, "__metadata__ 'n' is a JSON int"),
    ([1, 2], "__metadata__ is a JSON list"),
])
def test_safetensors_metadata_values_must_be_strings(tmp_path, metadata, needle):
    path = _safetensors(tmp_path / "d.safetensors", {"__metadata__": metadata, "logits": EMPTY})
    assert_one_line_error(run("inspect", path), needle)


def test_npz_member_declaring_a_wrapping_shape_is_refused(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (8, 2 ** 61)})
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("logits.npy", header.getvalue())  # the header says 2^64 elements; no data follows
    assert_one_line_error(run("inspect", path), "key 'logits'", "more than 2^48 elements")
