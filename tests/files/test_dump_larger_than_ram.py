"""A safetensors dump larger than RAM + swap opens and streams: chunks are mapped one at a time (a
private map of the whole file is charged to the commit limit at its full size, and with Linux's
default overcommit it fails with ENOMEM). The 64 GiB file is sparse: it takes no disk."""
import json
import os
import subprocess
import sys

import pytest
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


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
def test_streamed_chunks_stay_readable_after_later_chunks_and_close(tmp_path):
    """A chunk handed out by get(stream=True) views its own map: reading the next chunks, or closing
    the dump, must not unmap it under the tensor (that was a segfault, so this runs in a child)."""
    code = (
        "import sys, torch\n"
        "from mask_replay.files import safetensors_stream\n"
        "from mask_replay.files.dumps import Dump\n"
        "x = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)\n"
        "safetensors_stream.save(sys.argv[1], {'x': x})\n"
        "d = Dump(sys.argv[1])\n"
        "kept = [d.get('x', a, a + 512, stream=True) for a in range(0, 4096, 512)]\n"
        "d.close()\n"
        "assert all(torch.equal(k, x[i * 512:(i + 1) * 512]) for i, k in enumerate(kept))\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.safetensors")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


def test_inspect_reads_a_dump_larger_than_ram(tmp_path):
    path = tmp_path / "big.safetensors"
    sparse_dump(path)
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert str(ROWS) in result.output.replace(",", "")
