"""glibc's malloc told to keep the memory a step frees, so the next step reuses it unfaulted.

Without this, every activation of more than a few MB (a 2,048-token prefill's MLP output is 46
MB) is an mmap that munmap hands back when the tensor dies, and the next step faults the same
pages in again, zeroed, one 4 KiB page at a time. On the 2-core VM of benchmarks/RESULTS.md a
page fault costs ~5 us, and a 64-prompt float32 run took ~140k of them (0.4-1 s of system time
in a 7 s run). Keeping freed memory (no mmap for allocations, no trimming of the heap's top)
takes that to ~50 once the heap has grown to a step's peak (a few steps: a 64-byte-aligned
request does not fit the exact hole a freed one leaves until holes coalesce). The price is that
the process keeps its peak heap until it exits (the benchmark's 99M-parameter model: 1,405 MB
resident instead of 1,299), as an engine that owns its process does anyway (vLLM's CPU docs ask
for tcmalloc, which caches freed memory likewise).

Applied once per process by the cpu worker (``keep_freed_memory``); glibc only (other C
libraries have no mallopt, and nothing changes); PAGEDLLM_CPU_KEEP_FREED_MEMORY=0 turns it off.
Loading frees memory no step will use again (the plain weights the packed linears replace,
backends/cpu/ops.py): the worker hands those pages back once, after loading
(``release_free_pages``: malloc_trim), before the start-up step grows the heap to a step's peak.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from pagedllm import envs

logger = logging.getLogger(__name__)

KEEP_FREED_MEMORY_ENV = "PAGEDLLM_CPU_KEEP_FREED_MEMORY"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
_TOP_PAD_BYTES = 64 << 20  # the heap grows in 64 MiB steps: fewer brk calls while it grows
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: ~2 GiB of free heap top before a trim


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_pages() -> bool:
    """Hand the heap's free pages back to the system now (glibc's malloc_trim(0)); True when
    glibc released any."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    return trim(0) == 1


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Set glibc's malloc to serve every allocation from its heap and never shrink it; True when
    applied (glibc and not turned off by the environment)."""
    if not envs.PAGEDLLM_CPU_KEEP_FREED_MEMORY:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        logger.info("no glibc mallopt here: freed memory goes back to the C library's default")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NEVER_TRIM), (M_TOP_PAD, _TOP_PAD_BYTES)))
    if ok:
        logger.info("glibc malloc keeps freed memory for reuse (%s=0 turns this off)",
                    KEEP_FREED_MEMORY_ENV)
    return ok
