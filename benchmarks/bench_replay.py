"""Replay against the dense torch path, forward + backward, in one run.

    python benchmarks/bench_replay.py [--device cpu|cuda] [--runs 5]

1. replay_logprobs, N=4096, V=151936, mean |K| = 8 (about half singletons, median 2, heavy tail),
   against masked_fill(-inf) + log_softmax + gather + backward on the same fp32 logits.
2. replay_logprobs_from_hidden, N=1024, d=1024, V=151936, against hidden @ weight.T followed by the
   dense replay, with gradients w.r.t. hidden and weight; results compared to 1e-5.

Every path runs in its own subprocess, so one path's allocations cannot hide another's. Memory:
on CPU the peak resident set of that process (VmHWM, reset once the inputs exist; ru_maxrss
where the reset is not allowed) minus its resident set at that point, i.e. what the path itself adds at its
peak, including anything the allocator held on to;
on CUDA torch.cuda.max_memory_allocated minus the allocation after the inputs. Times are medians
of --runs runs after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

V = 151936


def support_sizes(n, seed=0, mean=8.0):
    """48% singletons, the rest 2 + floor(lognormal) with its scale chosen to give the mean."""
    rng = random.Random(seed)
    single = [rng.random() < 0.48 for _ in range(n)]
    base = [rng.lognormvariate(0.0, 1.6) for _ in range(n)]
    lo, hi = 1e-3, 1e3
    for _ in range(60):  # bisect the scale so the mean comes out right
        s = (lo * hi) ** 0.5
        sizes = [1 if one else min(2 + int(b * s), 4096) for one, b in zip(single, base)]
        lo, hi = (s, hi) if sum(sizes) / n < mean else (lo, s)
    return sizes


def make_mask(n, seed=0):
    import mask_replay as mr

    rng = random.Random(seed + 1)
    rows = [sorted(rng.sample(range(V), k)) for k in support_sizes(n, seed)]
    sampled = torch.tensor([r[rng.randrange(len(r))] for r in rows], dtype=torch.int64)
    return mr.SamplingMask.from_lists(rows), sampled


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    """Resets VmHWM (Linux >= 4.0) so the peak excludes the building of the inputs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(reset_ok):
    if reset_ok:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the paths, each run inside a worker process -------------------------------------------------
def logits_inputs(device):
    torch.manual_seed(0)
    mask, sampled = make_mask(4096)
    logits = torch.randn(4096, V).mul_(2).to(device)  # in place: no transient second copy
    return logits, mask.to(device), sampled.to(device)


def run_replay(logits, mask, sampled):
    import mask_replay as mr

    z = logits.detach().requires_grad_(True)
    lp = mr.replay_logprobs(z, mask, sampled)
    lp.sum().backward()
    return lp.detach(), z.grad


def run_dense(logits, mask, sampled):
    z = logits.detach().requires_grad_(True)
    dense_mask = mask.to_dense(V)
    lp = torch.log_softmax(z.masked_fill(~dense_mask, float("-inf")), dim=-1).gather(1, sampled[:, None])[:, 0]
    lp.sum().backward()
    return lp.detach(), z.grad


def hidden_inputs(device):
    torch.manual_seed(1)
    mask, sampled = make_mask(1024, seed=1)
    hidden = torch.randn(1024, 1024).to(device)
    weight = torch.randn(V, 1024).div_(32).to(device)
    return hidden, weight, mask.to(device), sampled.to(device)


def run_hidden_sparse(hidden, weight, mask, sampled):
    import mask_replay as mr

    h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    lp = mr.replay_logprobs_from_hidden(h, w, mask, sampled)
    lp.sum().backward()
    return lp.detach(), h.grad, w.grad


def run_hidden_dense(hidden, weight, mask, sampled):
    h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    logits = h @ w.T
    lp = torch.log_softmax(logits.masked_fill(~mask.to_dense(V), float("-inf")), dim=-1).gather(1, sampled[:, None])
    lp = lp[:, 0]
    lp.sum().backward()
    return lp.detach(), h.grad, w.grad


PATHS = {
    "replay": (logits_inputs, run_replay),
    "dense": (logits_inputs, run_dense),
    "hidden_sparse": (hidden_inputs, run_hidden_sparse),
    "hidden_dense": (hidden_inputs, run_hidden_dense),
}


def worker(name, device, runs, out_path):
    import mask_replay  # noqa: F401  (load the extension before measuring)

    device = torch.device(device)
    make, fn = PATHS[name]
    inputs = make(device)
    sync(device)
    reset_ok = reset_peak_rss()
    base_rss = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    result = fn(*inputs)  # warm-up, also the measured peak
    sync(device)
    peak = (torch.cuda.max_memory_allocated() - base_cuda) if device.type == "cuda" else (
        peak_rss_bytes(reset_ok) - base_rss)
    del result
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        result = fn(*inputs)
        sync(device)
        times.append(time.perf_counter() - t0)
        if _ < runs - 1:
            del result
    mask = inputs[-2]
    used = torch.unique(mask.token_ids.long())
    small = [result[0].cpu(), result[1].cpu()]
    if len(result) > 2:  # the weight gradient: only rows in some support can be non-zero
        gw = result[2]
        small.append(gw[used].cpu())
        gw[used] = 0
        small.append(float(gw.abs().max()))
    torch.save({"times": times, "peak": peak, "result": small}, out_path)


def spawn(name, device, runs):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--device", device,
               "--runs", str(runs), "--out", out]
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
        return torch.load(out)


def gib(b):
    return f"{b / 2**30:.2f} GiB"


def report(title, fast, slow, fast_name, slow_name, target):
    tf, ts = statistics.median(fast["times"]), statistics.median(slow["times"])
    print(f"\n{title}")
    print(f"  {fast_name:<34} median {tf * 1e3:10.1f} ms  peak +{gib(fast['peak'])}  runs {len(fast['times'])}")
    print(f"  {slow_name:<34} median {ts * 1e3:10.1f} ms  peak +{gib(slow['peak'])}  runs {len(slow['times'])}")
    print(f"  speed-up {ts / tf:.1f}x (target >= {target}x: {'met' if ts / tf >= target else 'NOT met'}), "
          f"memory ratio {slow['peak'] / max(fast['peak'], 1):.1f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dense-runs", type=int, default=3, help="runs of the (slow) dense paths")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.device, args.runs, args.out)

    import mask_replay as mr

    sizes = support_sizes(4096)
    srt = sorted(sizes)
    print(f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"build {mr.build_info()}")
    print(f"supports (N=4096): mean {sum(sizes) / len(sizes):.2f}, median {srt[len(srt) // 2]}, "
          f"singletons {sum(s == 1 for s in sizes) / len(sizes):.0%}, p99 {srt[int(0.99 * len(srt))]}, max {srt[-1]}")

    rep = spawn("replay", args.device, args.runs)
    den = spawn("dense", args.device, args.dense_runs)
    report("replay_logprobs fwd+bwd, N=4096 V=151936 fp32", rep, den, "replay_logprobs", "dense masked log_softmax", 3)
    print(f"  max |logp diff| {float((rep['result'][0] - den['result'][0]).abs().max()):.2e}, "
          f"max |grad diff| {float((rep['result'][1] - den['result'][1]).abs().max()):.2e}")

    hs = spawn("hidden_sparse", args.device, args.runs)
    hd = spawn("hidden_dense", args.device, args.dense_runs)
    report("replay_logprobs_from_hidden fwd+bwd, N=1024 d=1024 V=151936 fp32", hs, hd,
           "replay_logprobs_from_hidden", "hidden @ weight.T + dense replay", 50)
    diffs = [float((a - b).abs().max()) for a, b in zip(hs["result"][:3], hd["result"][:3])]
    ok = max(diffs) <= 1e-5
    print(f"  max |diff|: logp {diffs[0]:.2e}, grad hidden {diffs[1]:.2e}, grad weight (rows in K) {diffs[2]:.2e}; "
          f"max |grad weight| outside K: sparse {hs['result'][3]:.1e}, dense {hd['result'][3]:.1e} "
          f"-> {'same to 1e-5' if ok else 'DIFFERENT beyond 1e-5'}")


if __name__ == "__main__":
    main()
