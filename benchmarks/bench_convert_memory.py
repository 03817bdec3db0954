"""Peak memory of `mask-replay convert --from padded` and `--to padded` on a file of a given size
(issue 30: convert loaded the whole file, then built the other layout beside it). Writes a mask
file and a padded file of about `--mb` MB each (rows of 1 to 16 ids out of 151936, with entry
log-probs, `sampled` and `logprobs`), then runs, each alone in a child process,
`convert P --from padded --to mask` and `convert M --from mask --to padded`; a run's peak RSS is the
child's ru_maxrss (the wrapper of bench_score_memory.py), the baseline the same wrapper around
`python -c "import mask_replay.tools.convert"`. `--repo` names the checkouts whose package the
children run (default: this one), each measured on the same files (before / after a change). Every
file made is deleted at the end.

`--time-rows N` times instead, in this process, the whole-mask path (load_padded + save,
load + save_padded) against the chunked one (padded_to_mask_file, mask_file_to_padded) on files of N
rows, round-robin, medians of `--reps`, with `--threads` torch threads.

    python benchmarks/bench_convert_memory.py --mb 180 [--repo /work/main .] [--dir /tmp] [--reps 1]
    python benchmarks/bench_convert_memory.py --time-rows 200000 --reps 5 --threads 1
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from bench_score_memory import peak_kib

from mask_replay import SamplingMask
from mask_replay.csr import segment_logsumexp
from mask_replay.files.padded_file import load_padded, mask_file_to_padded, padded_to_mask_file, save_padded

VOCAB = 151936
WIDEST = 16
MASK_BYTES_PER_ROW = 8.5 * 8 + 8 + 8 + 4  # ids and entry log-probs of 8.5 ids, offsets, sampled, logprobs
PADDED_BYTES_PER_ROW = WIDEST * 8 + 4 + 8 + 4  # ids and entry log-probs [16], counts, sampled, logprobs


def make_mask(rows: int, seed: int = 0) -> SamplingMask:
    """Rows of 1..WIDEST ascending distinct ids (random gaps), normalised entry log-probs, the row's
    first id as the sampled token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDEST + 1, (rows,), generator=g)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    row = torch.repeat_interleave(torch.arange(rows), lengths, output_size=nnz)
    steps = torch.randint(1, VOCAB // WIDEST, (nnz,), generator=g)
    climb = torch.cumsum(steps, 0)
    ids = climb - (climb[offsets[:-1]] - steps[offsets[:-1]])[row]  # cumsum restarted at each row
    x = torch.randn(nnz, generator=g, dtype=torch.float64)
    entries = (x - segment_logsumexp(x, row, rows)[row]).float()
    first = offsets[:-1]
    return SamplingMask(ids.to(torch.int32), offsets, ids[first], entries[first], entry_logprobs=entries)


def time_paths(rows: int, reps: int, folder: str) -> None:
    m, p, out = (os.path.join(folder, n) for n in ("m.safetensors", "p.safetensors", "o.safetensors"))
    mask = make_mask(rows)
    mask.save(m)
    save_padded(mask, p)
    paths = {"from padded, whole": lambda: load_padded(p).save(out),
             "from padded, chunked": lambda: padded_to_mask_file(p, out),
             "to padded, whole": lambda: save_padded(SamplingMask.load(m), out),
             "to padded, chunked": lambda: mask_file_to_padded(m, out)}
    times = {k: [] for k in paths}
    for _ in range(reps):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"{rows} rows, torch threads {torch.get_num_threads()}, median of {reps} (s)")
    for name, ts in times.items():
        print(f"{name:22s} {statistics.median(ts):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=180.0, help="size of each input file, MB")
    ap.add_argument("--repo", nargs="+", default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=1, help="runs of each command (median)")
    ap.add_argument("--time-rows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(dir=args.dir)
    try:
        if args.time_rows:
            time_paths(args.time_rows, args.reps, folder)
            return
        mask_path, padded_path = os.path.join(folder, "m.safetensors"), os.path.join(folder, "p.safetensors")
        rows = int(args.mb * 1e6 / MASK_BYTES_PER_ROW)
        mask = make_mask(rows)
        mask.save(mask_path)
        save_padded(mask.select_rows(0, min(rows, int(args.mb * 1e6 / PADDED_BYTES_PER_ROW))), padded_path)
        del mask

        def peak(*argv):
            return statistics.median(peak_kib(sys.executable, *argv) for _ in range(args.reps))

        runs = (("--from padded --to mask", padded_path, ["--from", "padded", "--to", "mask"]),
                ("--from mask --to padded", mask_path, ["--from", "mask", "--to", "padded"]))
        print("package | command | input MB | baseline MiB | peak RSS MiB | above baseline MiB | above / input size")
        for repo in args.repo:
            os.chdir(repo)  # `-m mask_replay` imports the package of the working folder
            base = peak("-c", "import mask_replay.tools.convert")
            for name, src, flags in runs:
                p = peak("-m", "mask_replay", "convert", src, "-o", os.path.join(folder, "out.safetensors"), *flags)
                size = os.path.getsize(src)
                above = (p - base) * 1024
                print(f"{repo} | {name} | {size / 1e6:.0f} | {base / 1024:.0f} | {p / 1024:.0f} | "
                      f"{above / 2**20:.0f} | {above / size:.2f}", flush=True)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
