"""A torch profiler over a benchmark's region, saved as a chrome trace and two op tables (by
self device time, or self CPU time without a GPU; by total CPU time)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def start(device: str) -> Any:
    """A running profiler of the CPU and, on cuda, the GPU (stop it with ``save``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=acts)
    prof.__enter__()
    return prof


def save(prof: Any, folder: str | Path, name: str, device: str) -> None:
    """Stop ``prof``; write ``folder/name.json.gz`` (the trace) and ``folder/name.txt``."""
    prof.__exit__(None, None, None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"{name}.json.gz"))
    table = prof.key_averages()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    (folder / f"{name}.txt").write_text(table.table(sort_by=sort, row_limit=40) + "\n"
                                        + table.table(sort_by="cpu_time_total", row_limit=40))
