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
def _can_pin() -> bool:
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:  # no accelerator runtime to pin with
        return False


def to_device(data: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    if device.type == "cpu" or not _can_pin():
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device_many(items: Sequence[tuple[Sequence[Any], torch.dtype]],
                   device: torch.device) -> list[torch.Tensor]:
    """``[to_device(data, device, dtype) for data, dtype in items]`` in one host-to-device copy.

    Each copy is its own DMA transfer that the device runs in stream order between two steps'
    kernels (a few microseconds each, ~10 per step); here the arrays are packed into one pinned
    byte buffer (each at an 8-byte aligned offset) and come back as typed views of one device
    buffer.
    """
    host = [torch.tensor(data, dtype=dtype) for data, dtype in items]
    if device.type == "cpu" or not _can_pin():
        return [h.to(device) for h in host]
    staged, offsets = pack(host, pin_memory=True)
    return unpack(staged.to(device, non_blocking=True), host, offsets)


def pack(host: list[torch.Tensor], pin_memory: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(one uint8 buffer holding every tensor's bytes, each tensor's byte offset in it)."""
    offsets, total = [], 0
    for h in host:
        offsets.append(total)
        total += -(-h.numel() * h.element_size() // 8) * 8  # 8-byte aligned starts
    buf = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=pin_memory)
    for h, off in zip(host, offsets):
        n = h.numel() * h.element_size()
        if n:
            buf[off:off + n].copy_(h.reshape(-1).view(torch.uint8))
    return buf, offsets


def unpack(buf: torch.Tensor, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``buf`` (from ``pack``, possibly copied to a device) shaped and typed as ``like``."""
    return [buf[off:off + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
            for h, off in zip(like, offsets)]
