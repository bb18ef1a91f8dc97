"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls, after one warm-up
    call (lazy imports, cached tables)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
