"""Peak memory of `mask-replay capture` on large dumps of flat rows at --top-p .95 (issue 9 §5).

Flat rows are the worst case for the mask: top-p .95 keeps ~95% of the vocabulary, so the mask file
is about as large as an fp32 dump. The dump is written chunk by chunk (never whole in memory), then
captured by the CLI under /usr/bin/time -v; a poller samples the process's RssAnon (anonymous
memory: what a container limit cannot reclaim) every 20 ms. Every file made is deleted at the end.

    python benchmarks/bench_memory.py --gb 6 12 [--dir /tmp] [--vocab 151936]

Memory-heavy on disk (dump + mask, ~2x the size given), light on RAM; one size at a time.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

from mask_replay.files import safetensors_stream


def make_flat_dump(path: str, gb: float, vocab: int, chunk_rows: int = 256) -> int:
    """fp32 logits of near-flat rows (uniform noise of 0.01), written chunk by chunk; returns rows."""
    rows = int(gb * 1e9 // (vocab * 4))
    g = torch.Generator().manual_seed(0)
    with open(path, "w+b") as f:
        w = safetensors_stream.StreamWriter(f, {"logits": (torch.float32, (rows, vocab)),
                                            "sampled": (torch.int64, (rows,))})
        for a in range(0, rows, chunk_rows):
            b = min(rows, a + chunk_rows)
            z = torch.rand(b - a, vocab, generator=g) * 0.01
            w.write_rows("logits", a, z)
            w.write_rows("sampled", a, z.argmax(1))  # the top token is in every support
        w.finish()
    return rows


def peak_anon_kb(pid: int, stop: threading.Event, out: dict) -> None:
    """Largest RssAnon of `pid` and its children seen while it runs (/usr/bin/time is the parent)."""
    peak = 0
    while not stop.is_set():
        for p in [pid] + _children(pid):
            try:
                with open(f"/proc/{p}/status") as f:
                    m = re.search(r"RssAnon:\s+(\d+)", f.read())
                if m:
                    peak = max(peak, int(m.group(1)))
            except OSError:
                pass
        time.sleep(0.02)
    out["kb"] = peak


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def run_capture(dump: str, mask: str) -> dict:
    cli = [sys.executable, "-m", "mask_replay", "capture", dump, "-o", mask, "--top-p", "0.95"]
    proc = subprocess.Popen(["/usr/bin/time", "-v"] + cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, anon = threading.Event(), {}
    poll = threading.Thread(target=peak_anon_kb, args=(proc.pid, stop, anon))
    poll.start()
    out, err = proc.communicate()
    stop.set()
    poll.join()
    if proc.returncode != 0:
        raise SystemExit(f"capture failed:\n{err[-2000:]}")
    field = lambda name: re.search(rf"{re.escape(name)}: (.+)", err).group(1)  # noqa: E731
    return {"max_rss_mb": int(field("Maximum resident set size (kbytes)")) / 1024,
            "peak_anon_mb": anon["kb"] / 1024, "wall": field("Elapsed (wall clock) time (h:mm:ss or m:ss)")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[6, 12], help="dump sizes (GB of fp32 logits)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the dump and mask go (deleted after)")
    args = ap.parse_args()
    if not os.path.exists("/usr/bin/time"):
        raise SystemExit("needs /usr/bin/time (Debian: apt-get install time)")
    print(f"{'dump':>8} {'rows':>7} {'mask':>8} {'max RSS':>9} {'peak anon':>10} {'wall':>8}")
    for gb in args.gb:
        work = tempfile.mkdtemp(prefix="bench_memory.", dir=args.dir)
        try:
            dump, mask = os.path.join(work, "flat.safetensors"), os.path.join(work, "masks.safetensors")
            rows = make_flat_dump(dump, gb, args.vocab)
            r = run_capture(dump, mask)
            print(f"{os.path.getsize(dump) / 1e9:6.2f}GB {rows:>7} {os.path.getsize(mask) / 1e9:6.2f}GB "
                  f"{r['max_rss_mb']:7.0f}MB {r['peak_anon_mb']:8.0f}MB {r['wall']:>8}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
