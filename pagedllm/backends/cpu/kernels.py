"""The cpu backend's C++ kernels (csrc/cpu/), built on first use with the host C++ compiler.

``load_cpu_kernels()`` compiles csrc/cpu/*.cpp with torch.utils.cpp_extension.load (~20 s, once)
into the shared kernel cache (pagedllm/backends/kernel_build.py: $PAGEDLLM_CACHE_DIR, default
~/.cache/pagedllm/kernels/<hash of torch version, sources and flags>); later processes load the
cached library. The ops register with torch's dispatcher as ``torch.ops.pagedllm_cpu.*``, and
that namespace is what ``load_cpu_kernels()`` returns.

A build that fails (no compiler, no ninja, ...) is not retried in the same process: every later
call raises the same RuntimeError at once. ``PAGEDLLM_CPU_KERNELS=0`` turns the kernels off (then
``load_cpu_kernels()`` raises saying so).
Importing this module imports nothing heavy.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from pagedllm.backends.kernel_build import build_directory, csrc_dir, jit_load

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGEDLLM_CPU_KERNELS"
SOURCES = ("paged_attention_cpu.cpp", "layer_ops_cpu.cpp")
_lock = threading.Lock()
_ops: Any = None
_error: str | None = None


def cpu_kernels_disabled() -> bool:
    """True when $PAGEDLLM_CPU_KERNELS is 0 / false / off / no."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("0", "false", "off", "no")


def compile_flags() -> list[str]:
    """g++ flags: -O3 without contracting a * b + c into FMAs (layer_ops_cpu.cpp reproduces the
    torch reference's separately rounded products); -fopenmp where torch's thread pool is OpenMP (at::parallel_for is header
    code whose pragmas do nothing without it; the library then runs on torch's libgomp); AVX2 code
    for at::vec::Vectorized when this CPU runs torch's AVX2 (or AVX-512) kernels."""
    import torch

    flags = ["-O3", "-ffp-contract=off"]  # no fused multiply-adds the torch reference lacks
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def _build() -> Any:
    import torch

    src = csrc_dir()
    if src is None:
        raise RuntimeError("the csrc/cpu kernel sources were not found next to the package; "
                           "reinstall pagedllm with its csrc package data")
    sources = [str(src / "cpu" / name) for name in SOURCES]
    flags = compile_flags()
    build_dir = build_directory(sources, "cpu", {"cxx": flags})
    logger.info("loading the pagedllm cpu kernels from %s (the first use builds them, ~20 s)",
                build_dir)
    jit_load("pagedllm_cpu", sources, build_dir, is_python_module=False, extra_cflags=flags,
             extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
             verbose=os.environ.get("PAGEDLLM_VERBOSE_BUILD", "") == "1")
    return torch.ops.pagedllm_cpu


def load_cpu_kernels() -> Any:
    """``torch.ops.pagedllm_cpu``, building the kernels on first use; thread-safe, one build per
    process. Raises RuntimeError with the reason when they are disabled or cannot be built."""
    global _ops, _error
    if cpu_kernels_disabled():
        raise RuntimeError(f"the cpu kernels are disabled by {ENABLE_ENV}=0")
    with _lock:
        if _ops is not None:
            return _ops
        if _error is None:
            try:
                _ops = _build()
                return _ops
            except Exception as exc:  # noqa: BLE001 - compiler, ninja and loader errors vary
                _error = (f"cannot build the pagedllm cpu kernels (csrc/cpu): "
                          f"{type(exc).__name__}: {exc}")
        raise RuntimeError(_error)
