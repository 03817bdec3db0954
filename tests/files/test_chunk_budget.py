"""The default chunk counts every per-row buffer, not only the logits and the widest mask: a dump
with a tiny vocabulary gets chunks of a bounded number of rows, and capture's peak anonymous memory
stays under twice the chunk budget above the process's baseline, under 1 GB in all."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from mask_replay.files.dumps import DEFAULT_CHUNK_BYTES, PER_ROW_BYTES, default_chunk_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("vocab", [2, 3, 100, 32000, 2 ** 23 - 1])
@pytest.mark.parametrize("entry", [2, 8])
def test_chunk_rows_count_the_per_row_buffers(vocab, entry):
    rows = default_chunk_rows(vocab, entry)
    assert rows >= 1
    assert rows == 1 or rows * (vocab * entry + PER_ROW_BYTES) <= DEFAULT_CHUNK_BYTES
    assert rows <= DEFAULT_CHUNK_BYTES // PER_ROW_BYTES


def _peak_anon_mb(args, env) -> float:
    proc = subprocess.Popen([sys.executable, "-m", "mask_replay", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak, stop = [0], threading.Event()

    def poll():
        while not stop.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    m = re.search(r"RssAnon:\s+(\d+)", f.read())
                peak[0] = max(peak[0], int(m.group(1)) if m else 0)
            except OSError:
                pass
            time.sleep(0.01)

    t = threading.Thread(target=poll)
    t.start()
    _, err = proc.communicate(timeout=600)
    stop.set()
    t.join()
    assert proc.returncode == 0, err
    return peak[0] / 1024


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_capture_of_a_two_token_vocabulary_stays_within_budget(tmp_path):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8_000_000, 2, generator=g)
    save_file({"logits": z, "sampled": z.argmax(1)}, str(tmp_path / "r.safetensors"))
    del z
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    base = _peak_anon_mb(["info"], env)
    peak = _peak_anon_mb(["capture", str(tmp_path / "r.safetensors"), "-o", str(tmp_path / "m.safetensors")], env)
    assert peak < 1024
    assert peak - base < 2 * DEFAULT_CHUNK_BYTES / 2 ** 20, (peak, base)
