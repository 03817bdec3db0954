"""Capture and score on a dump of several GB against the time to only read the same file.

    python benchmarks/bench_cli.py [--gb 2.5] [--vocab 151936] [--dtype bf16] [--dir /tmp/bench_cli]

Writes a rollout dump of about --gb GB of logits (LLM-like rows from the demo generator, tiled with
per-block shifts so no two rows are equal), then times, each after one warm-up read so all three
see the same page cache:
  read     reading every logits chunk through the same lazy reader the commands use;
  capture  the library code of `mask-replay capture` (read + capture kernel + write);
  score    the library code of `mask-replay score` on the same file as training dump
           (read + replay + full log-prob), after the capture.
Target: capture and score within 2x of read. Record the output in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": (torch.bfloat16, "BF16"), "fp16": (torch.float16, "F16"), "fp32": (torch.float32, "F32")}
BLOCK_ROWS = 256
TOP_P = 0.95


def write_dump(path, rows, vocab, dtype_name, seed=0):
    """Stream a safetensors file block by block, so the dump may exceed RAM. safetensors' own writer
    needs every tensor in memory at once; the format (8-byte header length, JSON header, raw
    little-endian data) is simple enough to write incrementally here."""
    from mask_replay.tools.demo import DemoConfig, _step_logits

    dtype, st_name = DTYPES[dtype_name]
    el = torch.empty(0, dtype=dtype).element_size()
    logits_bytes = rows * vocab * el
    header = {
        "logits": {"dtype": st_name, "shape": [rows, vocab], "data_offsets": [0, logits_bytes]},
        "sampled": {"dtype": "I64", "shape": [rows], "data_offsets": [logits_bytes, logits_bytes + 8 * rows]},
        "top_p": {"dtype": "F32", "shape": [], "data_offsets": [logits_bytes + 8 * rows, logits_bytes + 8 * rows + 4]},
        "__metadata__": {"generator": "benchmarks/bench_cli.py"},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes
    gen = torch.Generator().manual_seed(seed)
    rank = torch.empty(vocab)
    rank[torch.randperm(vocab, generator=gen)] = torch.arange(1, vocab + 1, dtype=torch.float32)
    prior = -1.1 * torch.log(rank)
    cfg = DemoConfig(vocab=vocab, tokens_per_step=BLOCK_ROWS)
    base = _step_logits(cfg, prior, 0, gen).to(dtype)  # one realistic block, shifted per block
    sampled = torch.empty(rows, dtype=torch.int64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, a in enumerate(range(0, rows, BLOCK_ROWS)):
            b = min(rows, a + BLOCK_ROWS)
            block = torch.roll(base[: b - a], shifts=(i % BLOCK_ROWS, 7919 * i), dims=(0, 1)).contiguous()
            sampled[a:b] = torch.argmax(block, dim=1)  # the top token is in every support
            f.write(block.view(torch.uint8).numpy().tobytes())
        f.write(sampled.numpy().tobytes())
        f.write(torch.tensor(TOP_P, dtype=torch.float32).numpy().tobytes())


def time_read(path, chunk_rows):
    """Every logits chunk read into memory through the commands' reader. (safetensors hands out
    zero-copy views of its memory map, so the bytes are copied to make the read real.)"""
    from mask_replay.files.dumps import Dump

    t0 = time.perf_counter()
    with Dump(path) as d:
        n = d.shape("logits")[0]
        for a in range(0, n, chunk_rows):
            d.get("logits", a, min(n, a + chunk_rows)).clone()
    return time.perf_counter() - t0


def time_ops(path, masks, chunk_rows, top_p):
    """Time in the ops alone (chunks already in memory): capture, and replay + full log-prob."""
    import mask_replay
    from mask_replay import SamplingMask
    from mask_replay.files.dumps import Dump

    mask = SamplingMask.load(masks)
    t_cap = t_score = 0.0
    with Dump(path) as d, torch.no_grad():
        n = d.shape("logits")[0]
        for a in range(0, n, chunk_rows):
            b = min(n, a + chunk_rows)
            x, y = d.get("logits", a, b).clone(), mask.sampled[a:b]
            t0 = time.perf_counter()
            mask_replay.capture(x, top_p=top_p, sampled=y)
            t1 = time.perf_counter()
            mask_replay.replay_logprobs(x, mask.select_rows(a, b), y)
            mask_replay.full_logprobs(x, y)
            t_cap, t_score = t_cap + t1 - t0, t_score + time.perf_counter() - t1
    return t_cap, t_score


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.5, help="size of the logits in GB (1e9 bytes)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--dir", default="/tmp/bench_cli")
    ap.add_argument("--chunk-rows", type=int, default=None, help="default: the commands' default")
    ap.add_argument("--keep", action="store_true", help="keep the dump (reused next time if the same size)")
    args = ap.parse_args()

    import mask_replay
    from mask_replay.files.dumps import default_chunk_rows
    from mask_replay.tools.capture import MASK_ENTRY_BYTES, capture_dumps
    from mask_replay.tools.score import score_files

    dtype = DTYPES[args.dtype][0]
    el = torch.empty(0, dtype=dtype).element_size()
    rows = max(1, int(args.gb * 1e9) // (args.vocab * el))
    chunk = args.chunk_rows or default_chunk_rows(args.vocab, el + MASK_ENTRY_BYTES)
    os.makedirs(args.dir, exist_ok=True)
    dump = os.path.join(args.dir, f"rollout_{rows}x{args.vocab}_{args.dtype}.safetensors")
    masks = os.path.join(args.dir, "masks.safetensors")
    if not os.path.exists(dump):
        t0 = time.perf_counter()
        write_dump(dump, rows, args.vocab, args.dtype)
        print(f"wrote {dump} in {time.perf_counter() - t0:.1f} s")
    size = os.path.getsize(dump)
    print(f"dump: {rows} rows x {args.vocab} {args.dtype} = {size / 1e9:.2f} GB; chunk {chunk} rows; "
          f"torch threads {torch.get_num_threads()}; build {mask_replay.build_info().get('cpu_isa')}")

    time_read(dump, chunk)  # warm-up: every timing below sees the same page cache
    t_read = time_read(dump, chunk)
    gb = size / 1e9
    print(f"read            {t_read:7.2f} s  {gb / t_read:6.2f} GB/s")

    summary = capture_dumps([dump], masks, chunk_rows=chunk, progress=False)
    t_cap = summary.seconds
    s = summary.stats()
    print(f"capture         {t_cap:7.2f} s  {gb / t_cap:6.2f} GB/s  {t_cap / t_read:6.2f}x read (target <= 2x); "
          f"support mean {s['support_mean']:.1f}, median {s['support_median']:.0f}, "
          f"singletons {s['singleton_share']:.2f}")

    t0 = time.perf_counter()
    score_files(masks, dump, chunk_rows=chunk, progress=False)
    t_score = time.perf_counter() - t0
    print(f"score           {t_score:7.2f} s  {gb / t_score:6.2f} GB/s  {t_score / t_read:6.2f}x read (target <= 2x)")

    k_cap, k_score = time_ops(dump, masks, chunk, TOP_P)
    print(f"  capture op    {k_cap:7.2f} s  {gb / k_cap:6.2f} GB/s  (in-memory chunks; the rest of capture's "
          f"time, {t_cap - k_cap:.2f} s, is reading, checks and writing)")
    print(f"  replay+full   {k_score:7.2f} s  {gb / k_score:6.2f} GB/s  (in-memory chunks; the rest of score's "
          f"time, {t_score - k_score:.2f} s, is reading, checks and metrics)")
    os.unlink(masks)
    if not args.keep:
        os.unlink(dump)


if __name__ == "__main__":
    main()
