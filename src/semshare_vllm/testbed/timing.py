"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int, device: str = "cpu") -> float:
    """Median time of ``fn()`` in milliseconds over ``repeats`` calls, after one warm-up call
    (lazy imports, cached tables, a kernel's compile): wall time, or on ``device="cuda"`` the
    device's time between CUDA events around each call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            import torch

            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
