"""Zero-filled host tensors that cost nothing until touched (anonymous mmap pages)."""
from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like torch.zeros on the CPU, but pages are mapped on first write instead of up front.

    The kernel guarantees anonymous mappings read as zeros, so a multi-GiB KV cache is ready
    at once and only the blocks actually used take memory. The mapping asks for transparent huge
    pages where the kernel has them (madvise mode): a first write then maps 2 MiB at once instead
    of 4 KiB, 512x fewer page faults (~5 us each on the VM of benchmarks/RESULTS.md, where 4 KiB
    faults took a decode step's cache writes from ~15 to ~190 us).
    """
    itemsize = torch.tensor([], dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive
