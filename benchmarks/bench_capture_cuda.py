"""GPU timing of the CUDA capture kernels against the memory floor and the usual alternatives.

    python benchmarks/bench_capture_cuda.py [--iters 200]

Prints, per case: capture (CSR op, which syncs once for nnz), capture_fixed (no sync), one full
read of the logits (torch.sum: the bandwidth floor), the sort-based path engines use, torch.topk
and FlashInfer's top_p_renorm_probs / top_k_mask_logits when flashinfer imports. Times are medians
of CUDA-event measurements.
"""
import argparse
import sys

import torch
from timing import time_us

CASES = [  # (rows, vocab, dtype, filter)
    (256, 151936, torch.float32, "top_p"),
    (256, 151936, torch.float32, "top_k"),
    (1, 151936, torch.float32, "top_p"),
    (1, 151936, torch.float32, "top_k"),
    (64, 151936, torch.float32, "top_p"),
    (64, 151936, torch.float32, "top_k"),
    (256, 151936, torch.bfloat16, "top_p"),
    (256, 151936, torch.bfloat16, "top_k"),
]
TOP_P, TOP_K, WIDTH = 0.95, 50, 4096
DEVICE = torch.device("cuda")


def sort_top_p(logits, p):
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1)
    cum = torch.cumsum(sorted_probs, dim=-1)
    drop = cum <= 1 - p
    drop[:, -1] = False
    return torch.zeros_like(drop).scatter_(-1, order, ~drop)


def sort_top_k(logits, k):
    sorted_vals, _ = torch.sort(logits, dim=-1, descending=True)
    return logits >= sorted_vals[:, k - 1 : k]


def flashinfer_fns():
    try:
        import flashinfer  # noqa: F401
        from flashinfer.sampling import top_k_mask_logits, top_p_renorm_probs
    except Exception as exc:  # not installed, or built for another torch
        return None, f"flashinfer unavailable ({type(exc).__name__})"
    return (top_p_renorm_probs, top_k_mask_logits), "flashinfer"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_capture_cuda: no CUDA device here; nothing to measure.")
        return 0
    import mask_replay
    from mask_replay.params import expand_params

    if not mask_replay.build_info().get("cuda"):
        print("bench_capture_cuda: mask_replay was built without CUDA kernels; rebuild with CUDA.")
        return 1
    ops = torch.ops.mask_replay
    fi, fi_note = flashinfer_fns()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {fi_note}")
    header = (f"{'case':34} {'capture':>9} {'fixed':>9} {'1 read':>9} {'sort':>10} {'topk':>9} "
              f"{'flashinf':>9} {'cap/read':>8} {'sort/cap':>8} {'cap/fi':>7}")
    print(header)
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, v, dtype, what in CASES:
        logits = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dtype)
        kw = dict(top_p=TOP_P) if what == "top_p" else dict(top_k=TOP_K)
        t, k, p, mp = expand_params(n, logits.device, 1.0, kw.get("top_k"), kw.get("top_p"), None)
        cap = time_us(lambda: ops.capture(logits, t, k, p, mp, False), args.iters, DEVICE)
        fixed = time_us(lambda: ops.capture_fixed(logits, t, k, p, mp, WIDTH), args.iters, DEVICE)
        read = time_us(lambda: torch.sum(logits), args.iters, DEVICE)
        if what == "top_p":
            sort = time_us(lambda: sort_top_p(logits, TOP_P), max(10, args.iters // 10), DEVICE)
        else:
            sort = time_us(lambda: sort_top_k(logits, TOP_K), max(10, args.iters // 10), DEVICE)
        topk = time_us(lambda: torch.topk(logits, TOP_K, dim=-1), args.iters, DEVICE)
        fi_t = float("nan")
        if fi is not None:
            try:
                if what == "top_p":
                    probs = torch.softmax(logits.float(), dim=-1)
                    fi_t = time_us(lambda: fi[0](probs, TOP_P), args.iters, DEVICE)
                else:
                    lf = logits.float()
                    fi_t = time_us(lambda: fi[1](lf, TOP_K), args.iters, DEVICE)
            except Exception as exc:  # keep the other figures if one call fails
                print(f"  flashinfer call failed: {exc}")
        name = f"[{n},{v}] {str(dtype).replace('torch.', '')} {what}"
        print(f"{name:34} {cap:9.1f} {fixed:9.1f} {read:9.1f} {sort:10.1f} {topk:9.1f} {fi_t:9.1f} "
              f"{cap / read:8.2f} {sort / cap:8.1f} {cap / fi_t:7.2f}")
    print("times in microseconds (median); cap/read target <= 3, sort/cap >= 10, cap/fi <= 1; "
          "batch 1 target < 30 us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
