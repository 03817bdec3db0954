"""GPU profile of every op against one read of its input (the bandwidth floor), for the first GPU run.

    python benchmarks/gpu_profile.py [--iters 30] [--json out.json] [--dry-run]

Sections (issue 16's list): capture and capture_fixed on [256, 151936] fp32/bf16 with top-k 50,
top-p 0.95 and both, against x.sum(), torch.topk and the sort path engines use, with a
torch.profiler table of the kernels of one capture; batch-1 capture_fixed replayed in a CUDA graph;
kept_mass, full_logprobs and replay forward+backward (with and without one fallback row) at
N = 256 and 4096; the hidden-state head forward+backward (dense and sparse weight gradient) with
and without a token present in every row, against the dense weight-gradient GEMM. Times are
medians of CUDA-event measurements in microseconds. One section failing prints its error and the
next one runs. --dry-run: tiny shapes on the CPU (host timer), to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import time_us
from torch.profiler import ProfilerActivity, profile

import mask_replay
from mask_replay.params import expand_params

ops = torch.ops.mask_replay
RESULTS: list = []


def report(section: str, case: str, **times_us):
    """One line per case; ratios against `read` (one pass over the input) when it is there."""
    read = times_us.get("read")
    parts = [f"{k} {v:9.1f}" + (f" ({v / read:5.2f}x read)" if read and k != "read" else "")
             for k, v in times_us.items()]
    print(f"{section:10} {case:38} " + "  ".join(parts), flush=True)
    RESULTS.append({"section": section, "case": case, **{f"{k}_us": v for k, v in times_us.items()}})


def sort_top_p(x, p):
    probs = torch.softmax(x.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1)
    drop = torch.cumsum(sorted_probs, dim=-1) <= 1 - p
    drop[:, -1] = False
    return torch.zeros_like(drop).scatter_(-1, order, ~drop)


def section_capture(dev, shape, iters):
    n, v = shape
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(n, v, device=dev, generator=g) * 3).to(dtype)
        read = time_us(lambda: x.sum(), iters, dev)
        topk = time_us(lambda: torch.topk(x, 50, dim=-1), iters, dev)
        sort = time_us(lambda: sort_top_p(x, 0.95), max(5, iters // 3), dev)
        for name, kw in (("top_k=50", dict(top_k=50)), ("top_p=0.95", dict(top_p=0.95)),
                         ("top_k=50 top_p=0.95", dict(top_k=50, top_p=0.95))):
            a = expand_params(n, dev, 1.0, kw.get("top_k"), kw.get("top_p"), None)
            report("capture", f"[{n},{v}] {str(dtype)[6:]} {name}", read=read,
                   capture=time_us(lambda: ops.capture(x, *a, False), iters, dev),
                   fixed4096=time_us(lambda: ops.capture_fixed(x, *a, 4096), iters, dev),
                   topk=topk, sort_top_p=sort)


def section_kernel_table(dev, shape):
    """Per-kernel breakdown of one capture (top-k and top-p together: every pass runs)."""
    n, v = shape
    x = torch.randn(n, v, device=dev) * 3
    a = expand_params(n, dev, 1.0, 50, 0.95, None)
    ops.capture(x, *a, False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            ops.capture(x, *a, False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)


def section_graph(dev, v, iters):
    """Batch-1 capture_fixed replayed in a CUDA graph (the engine-step use)."""
    x = torch.randn(1, v, device=dev)
    a = expand_params(1, dev, 1.0, 50, 0.9, None)
    if dev.type != "cuda":
        report("graph", f"[1,{v}] capture_fixed (no graph on cpu)", fixed256=time_us(
            lambda: ops.capture_fixed(x, *a, 256), iters, dev))
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as graph capture requires
        ops.capture_fixed(x, *a, 256)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.capture_fixed(x, *a, 256)
    report("graph", f"[1,{v}] capture_fixed width 256", read=time_us(lambda: x.sum(), iters, dev),
           graph_replay=time_us(graph.replay, iters, dev),
           eager=time_us(lambda: ops.capture_fixed(x, *a, 256), iters, dev))


def section_replay(dev, rows, v, iters):
    """Full-vocabulary paths (kept_mass, full_logprobs) and replay over a top-k 50 support."""
    for n in rows:
        x = torch.randn(n, v, device=dev) * 2
        mask = mask_replay.capture(x, top_k=50)
        y = mask.token_ids[mask.offsets[:-1]].long()  # the first token of every row: inside
        y_out = y.clone()
        y_out[0] = int(torch.argmin(x[0]))  # outside its support: one fallback row
        xg = x.clone().requires_grad_()

        def fwd_bwd(sampled):
            xg.grad = None
            mask_replay.replay_logprobs(xg, mask, sampled, fallback=True).sum().backward()

        def full_fwd_bwd():
            xg.grad = None
            mask_replay.full_logprobs(xg, y).sum().backward()

        report("replay", f"[{n},{v}] fp32", read=time_us(lambda: x.sum(), iters, dev),
               kept_mass=time_us(lambda: mask_replay.kept_mass(x, mask), iters, dev),
               full_fwd=time_us(lambda: mask_replay.full_logprobs(x, y), iters, dev),
               full_fwd_bwd=time_us(full_fwd_bwd, iters, dev),
               replay_fwd=time_us(lambda: mask_replay.replay_logprobs(x, mask, y), iters, dev),
               replay_fwd_bwd=time_us(lambda: fwd_bwd(y), iters, dev),
               fwd_bwd_1_fallback=time_us(lambda: fwd_bwd(y_out), iters, dev))


def dense_weight_grad_us(h, v, iters, dev) -> float:
    """The dense LM head's weight gradient, coef[N, V]^T @ hidden[N, d]: what the sparse paths avoid."""
    coef = torch.randn(h.shape[0], v, device=dev, dtype=h.dtype)
    return time_us(lambda: coef.T @ h, iters, dev)


def section_hidden(dev, n, d, v, iters):
    """The LM head without the [N, V] projection; a hot token (in every row) is one long run of
    rows for the weight gradient. The baseline is the dense weight-gradient GEMM."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(v, d, device=dev, dtype=torch.bfloat16) / d ** 0.5).requires_grad_()
    hl = h.clone().requires_grad_()
    gemm = dense_weight_grad_us(h, v, max(3, iters // 3), dev)
    for hot in (False, True):
        rows = [sorted(set(torch.randint(v, (7,), generator=g).tolist()) | ({13} if hot else set()))
                for _ in range(n)]
        mask = mask_replay.SamplingMask.from_lists(rows).to(dev)
        y = torch.tensor([r[0] for r in rows], device=dev)

        def step(sparse):
            hl.grad = w.grad = None
            mask_replay.replay_logprobs_from_hidden(hl, w, mask, y, sparse_grad=sparse).sum().backward()

        report("hidden", f"N={n} d={d} V={v} bf16 hot={hot}", dense_grad_gemm=gemm,
               fwd_bwd=time_us(lambda: step(False), iters, dev),
               fwd_bwd_sparse=time_us(lambda: step(True), iters, dev))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script itself")
    args = ap.parse_args()
    if args.dry_run:
        dev, iters = torch.device("cpu"), 3
        shape, vocab, rows, hidden = (8, 2000), 2000, (8,), (64, 32, 2000)
    else:
        if not torch.cuda.is_available() or not mask_replay.build_info().get("cuda"):
            print("gpu_profile: no CUDA device or no CUDA kernels built here; nothing measured "
                  "(--dry-run checks the script on the CPU)")
            return 0
        dev, iters = torch.device("cuda"), args.iters
        shape, vocab, rows, hidden = (256, 151936), 151936, (256, 4096), (4096, 4096, 151936)
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sections = [
        ("capture", lambda: section_capture(dev, shape, iters)),
        ("kernels", lambda: section_kernel_table(dev, shape)),
        ("graph", lambda: section_graph(dev, vocab, iters)),
        ("replay", lambda: section_replay(dev, rows, vocab, max(5, iters // 2))),
        ("hidden", lambda: section_hidden(dev, *hidden, max(3, iters // 6))),
    ]
    failed = 0
    for name, run in sections:
        try:
            run()
        except Exception as exc:  # report and go on: the other sections still measure
            failed += 1
            print(f"{name:10} FAILED {type(exc).__name__}: {' '.join(str(exc).split())[:300]}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "results": RESULTS}, f, indent=1)
    print(f"gpu_profile: {len(RESULTS)} cases measured, {failed} section(s) failed; times are medians in us")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
