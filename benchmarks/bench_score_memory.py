"""Peak memory of `mask-replay score` against the number of rows (issue 30, item 4: score held
O(rows) per-row arrays; it now streams its report, tools/score_stats.py). For each row count: a
rollout of small rows (vocab 16, so the logits themselves stay small and the per-row state shows),
`capture --top-k 4`, a training dump near it, then `score --chunk-rows 65536` (4 MiB of logits
per chunk, so the per-row state dominates) alone in a child process; its peak RSS is the child's
ru_maxrss (resource.getrusage(RUSAGE_CHILDREN) in a wrapper that runs nothing else). The baseline is the same
wrapper around `python -c "import mask_replay.tools.score"` (interpreter, torch, the package).
The last column is what the mask file's per-row keys take (offsets, sampled, logprobs, ...), what
score would hold if MaskFile read them whole at open (it did until it read them per chunk, RowKey in
files/mask_file.py).
Every file made is deleted at the end.

    python benchmarks/bench_score_memory.py --rows 1000000 10000000 [--dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from mask_replay.files import safetensors_stream
from mask_replay.files.dumps import Dump

VOCAB = 16
CHUNK = 1 << 16
# runs argv[1:] as its only child and prints that child's peak RSS in KiB
WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def write_dump(path: str, rows: int, noise: float, with_sampled: bool) -> None:
    """fp32 logits written chunk by chunk (never whole in memory); the same seed for rollout and
    training, the training dump `noise` off it."""
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    head = {"logits": (torch.float32, (rows, VOCAB))}
    if with_sampled:
        head["sampled"] = (torch.int64, (rows,))
    with open(path, "w+b") as f:
        w = safetensors_stream.StreamWriter(f, head)
        for a in range(0, rows, CHUNK):
            b = min(rows, a + CHUNK)
            z = torch.randn(b - a, VOCAB, generator=g) * 2
            w.write_rows("logits", a, z + noise * torch.randn(b - a, VOCAB, generator=h) if noise else z)
            if with_sampled:
                w.write_rows("sampled", a, z.argmax(1))  # in every top-k support
        w.finish()


def mask_row_bytes(path: str) -> int:
    """Bytes of the mask file's per-row keys (all but the per-entry token_ids / entry_logprobs)."""
    with Dump(path) as d:
        return sum(d.nbytes(k) for k in d.keys() if k not in ("token_ids", "entry_logprobs"))


def peak_kib(*argv: str) -> int:
    out = subprocess.run([sys.executable, "-c", WRAPPER, *argv], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = peak_kib(sys.executable, "-c", "import mask_replay.tools.score")
    print(f"baseline (import): {base / 1024:.0f} MiB")
    print("rows | training dump MB | score peak RSS MiB | above baseline MiB | bytes/row above baseline | "
          "mask file per-row keys, bytes/row")
    for rows in args.rows:
        folder = tempfile.mkdtemp(dir=args.dir)
        try:
            r, t, m = (os.path.join(folder, n) for n in ("r.safetensors", "t.safetensors", "m.safetensors"))
            write_dump(r, rows, 0.0, True)
            write_dump(t, rows, 0.05, False)
            subprocess.run([sys.executable, "-m", "mask_replay", "capture", r, "-o", m, "--top-k", "4"],
                           check=True, capture_output=True)
            peak = peak_kib(sys.executable, "-m", "mask_replay", "score", "--masks", m, "--training", t,
                            "--json", os.path.join(folder, "s.json"), "--chunk-rows", str(CHUNK))
            above = (peak - base) * 1024
            print(f"{rows} | {os.path.getsize(t) / 1e6:.0f} | {peak / 1024:.0f} | {above / 2**20:.0f} | "
                  f"{above / rows:.0f} | {mask_row_bytes(m) / rows:.0f}", flush=True)
        finally:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
