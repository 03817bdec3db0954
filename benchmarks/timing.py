"""The benchmarks' timer: median microseconds of a call, by CUDA events on a GPU (the kernels are
asynchronous: wall time around a launch measures the launch), by perf_counter on the CPU."""
import statistics
import time

import torch


def time_us(fn, iters: int, device: torch.device) -> float:
    """Median time of fn in microseconds (CUDA events on a GPU, the host clock on the CPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)
