"""Zero-filled host tensors that cost nothing until touched (anonymous mmap pages)."""
from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like torch.zeros on the CPU, but pages are mapped on first write instead of up front.

    The kernel guarantees anonymous mappings read as zeros, so a multi-GiB KV cache is ready
    at once and only the blocks actually used take memory.
    """
    itemsize = torch.tensor([], dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive
