"""Small host lists to device tensors without stalling the device's queue.

``torch.tensor(data, device=...)`` copies from pageable memory and waits for the device's queue to
drain first, so a step scheduled while the previous one runs would wait for it. Staging the data in
pinned memory and copying with ``non_blocking=True`` queues the copy instead.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch


@functools.lru_cache(maxsize=None)
def can_pin() -> bool:
    """Whether pinned host memory can be allocated (an accelerator runtime is present)."""
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:  # no accelerator runtime to pin with
        return False


def to_device(data: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    if device.type == "cpu" or not can_pin():
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` for a host list of row indices: a view where they are consecutive and in
    order (no index copied to the device, no gather), else a gather by an index copied as above."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0]:rows[0] + len(rows)]
    return x[to_device(rows, x.device, torch.int64)]
