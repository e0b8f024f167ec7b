"""Timing the routes a cpu op may take, once per process (backends/cpu/ops.py's linear routes,
backends/cpu/few_rows.py's few-rows kernel)."""
from __future__ import annotations

import time
from typing import Any, Callable


def median_times(runs: dict[str, Callable[[], Any]], rounds: int = 7) -> dict[str, float]:
    """Median seconds of each run, the runs timed in alternation after two warm-up rounds (which
    create oneDNN's primitives)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}
