"""A safetensors dump larger than RAM + swap opens and streams: chunks are mapped one at a time (a
private map of the whole file is charged to the commit limit at its full size, and with Linux's
default overcommit it fails with ENOMEM). The 64 GiB file is sparse: it takes no disk."""
import json
import os

import torch

from mask_replay.files.dumps import Dump
from tests.helpers import run

ROWS, VOCAB = 1 << 18, 1 << 16  # 2**34 float32 = 64 GiB


def sparse_dump(path) -> None:
    header = json.dumps({"logits": {"dtype": "F32", "shape": [ROWS, VOCAB], "data_offsets": [0, ROWS * VOCAB * 4]}})
    header += " " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header.encode())
        f.truncate(8 + len(header) + ROWS * VOCAB * 4)


def test_a_sparse_64_gib_dump_streams_its_first_and_last_rows(tmp_path):
    path = tmp_path / "big.safetensors"
    sparse_dump(path)
    assert os.path.getsize(path) > 1 << 36
    with Dump(str(path)) as dump:
        for start in (0, ROWS // 2 + 3, ROWS - 4):
            rows = dump.get("logits", start, start + 4, stream=True)
            assert rows.shape == (4, VOCAB) and rows.dtype == torch.float32
            assert not rows.any()  # a hole reads as zeros
            del rows


def test_inspect_reads_a_dump_larger_than_ram(tmp_path):
    path = tmp_path / "big.safetensors"
    sparse_dump(path)
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert str(ROWS) in result.output.replace(",", "")
