"""Layer-wise fences (plugin API 2.3): an import fenced with ``CacheTransfer.fence_layers``
registers, per layer cache, a wait that the attention of that layer runs before it reads the
cache (``AttentionImpl.attend``), so layer l computes while later layers still copy. A cache is
named by its storage address; nothing is registered unless a backend's transfer does it, so
``consume`` costs one dict test per layer otherwise."""
from __future__ import annotations

from collections.abc import Callable

import torch

_waits: dict[int, list[Callable[[], None]]] = {}


def add(cache: torch.Tensor, wait: Callable[[], None]) -> None:
    """Run ``wait`` (e.g. make the current stream wait for an event) before the next attention
    that reads ``cache``."""
    _waits.setdefault(cache.data_ptr(), []).append(wait)


def consume(cache: torch.Tensor) -> None:
    """The attention is about to read ``cache``: run the waits registered for it."""
    if _waits:
        for wait in _waits.pop(cache.data_ptr(), ()):
            wait()


def consume_all() -> None:
    """Run every registered wait (before device work that bypasses the attention's Python code:
    a captured graph's replay)."""
    while _waits:
        for wait in _waits.popitem()[1]:
            wait()


def pending() -> int:
    """Caches with waits not yet run."""
    return len(_waits)
