"""The cpu backend's C++ kernels (csrc/cpu/), built on first use with the host C++ compiler.

``load_cpu_kernels()`` compiles csrc/cpu/*.cpp with torch.utils.cpp_extension.load (~15 s per
library, once) into the shared kernel cache (pagedllm/backends/kernel_build.py:
$PAGEDLLM_CACHE_DIR, default ~/.cache/pagedllm/kernels/<hash of torch version, sources and
flags>); later processes load the cached libraries. Two libraries, each built for its own ISA
(``LIBRARIES``): the attention (paged_attention_cpu.cpp: decode, prefill_attention_cpu.cpp:
prefill; shared checks in attention_args.h, vector helpers in attention_vec.h) is written for AVX2, the layer
ops, the greedy sampler and guided decoding's token mask (layer_ops_cpu.cpp, sampling_cpu.cpp,
bitmask_cpu.cpp) follow torch's own CPU kernels
(AVX-512 where torch runs AVX-512), so that their vectorized exp and log are torch's and bf16/fp16
convert 16 lanes at a time. Both register
with torch's dispatcher as ``torch.ops.pagedllm_cpu.*``, and that namespace is what
``load_cpu_kernels()`` returns.

A build that fails (no compiler, no ninja, ...) is not retried in the same process: every later
call raises the same RuntimeError at once. ``PAGEDLLM_CPU_KERNELS=0`` turns the kernels off (then
``load_cpu_kernels()`` raises saying so).
Importing this module imports nothing heavy.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.backends.kernel_build import build_directory, csrc_dir, jit_load

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGEDLLM_CPU_KERNELS"
# library name -> (its csrc/cpu sources, the ISA it is built for: "avx2", or "torch" for the one
# torch's CPU kernels run here)
LIBRARIES: dict[str, tuple[tuple[str, ...], str]] = {
    # defines the op namespace; decode and prefill attention
    "pagedllm_cpu": (("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp"), "avx2"),
    "pagedllm_cpu_layers": (("layer_ops_cpu.cpp", "sampling_cpu.cpp", "bitmask_cpu.cpp"), "torch"),
    # the INT8 lowp mode's activation quantization and rescale (backends/cpu/quant_lowp.py);
    # the INT4 dequantize route's unpacking (backends/cpu/quant_ops.py)
    "pagedllm_cpu_quant": (("quant_lowp_cpu.cpp", "quant_dequant_cpu.cpp"), "torch"),
    # OpenMP thread placement: bind_omp_threads (backends/cpu/threads.py)
    "pagedllm_cpu_threads": (("threads_cpu.cpp",), "torch"),
    # the MoE layer on packed experts in one call (backends/cpu/fused_moe.py)
    "pagedllm_cpu_moe": (("fused_moe_cpu.cpp",), "torch"),
}
# headers the sources include: hashed into every library's build directory name (not compiled)
HEADERS = ("attention_args.h", "attention_vec.h", "vec_math.h")
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
           "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
_lock = threading.Lock()
_ops: Any = None
_error: str | None = None


def cpu_kernels_disabled() -> bool:
    """True when $PAGEDLLM_CPU_KERNELS is off (pagedllm/envs.py's on/off grammar)."""
    return not envs.PAGEDLLM_CPU_KERNELS


def compile_flags(library: str = "pagedllm_cpu") -> list[str]:
    """g++ flags of ``library`` (a key of LIBRARIES): -O3 without contracting a * b + c into FMAs
    (layer_ops_cpu.cpp reproduces the torch reference's separately rounded products); -fopenmp
    where torch's thread pool is OpenMP (at::parallel_for is header code whose pragmas do nothing
    without it; the library then runs on torch's libgomp); at::vec::Vectorized code for AVX2 when
    this CPU runs torch's AVX2 (or AVX-512) kernels, or for AVX-512 where the library follows
    torch's ISA and torch runs AVX-512."""
    import torch

    if library not in LIBRARIES:
        raise ValueError(f"unknown cpu kernel library {library!r}; known: {', '.join(LIBRARIES)}")
    flags = ["-O3", "-ffp-contract=off"]  # no fused multiply-adds the torch reference lacks
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and LIBRARIES[library][1] == "torch":
        flags += _AVX512
    elif capability in ("AVX2", "AVX512"):
        flags += _AVX2
    return flags


def library_build_dir(library: str) -> Path:
    """The kernel-cache directory of ``library`` (a key of LIBRARIES): named by the hash of its
    sources, the shared headers, its flags and the torch version."""
    src = csrc_dir()
    if src is None:
        raise RuntimeError("the csrc/cpu kernel sources were not found next to the package; "
                           "reinstall pagedllm with its csrc package data")
    files = LIBRARIES[library][0] + HEADERS
    return build_directory([str(src / "cpu" / f) for f in files], "cpu",
                           {"cxx": compile_flags(library)})


def _build() -> Any:
    import torch

    src = csrc_dir()
    if src is None:
        raise RuntimeError("the csrc/cpu kernel sources were not found next to the package; "
                           "reinstall pagedllm with its csrc package data")
    for name, (files, _) in LIBRARIES.items():
        sources = [str(src / "cpu" / f) for f in files]
        flags = compile_flags(name)
        build_dir = library_build_dir(name)
        logger.debug("loading %s from %s", name, build_dir)
        jit_load(name, sources, build_dir, is_python_module=False, build_time="~15 s",
                 extra_cflags=flags,
                 extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                 verbose=envs.PAGEDLLM_VERBOSE_BUILD)
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


_optional: Any = None  # load_cpu_kernels() for optional fast paths; False where it raised
_optional_logged: set[str] = set()


def optional_cpu_kernels(purpose: str) -> Any:
    """``torch.ops.pagedllm_cpu`` for a fast path that has a torch fallback, or False where the
    kernels do not load (memoized: hot paths call this per op; the reason is logged once per
    ``purpose``, which names the fallback)."""
    global _optional
    if _optional is None:
        try:
            _optional = load_cpu_kernels()
        except RuntimeError as exc:
            _optional = False
            logger.info("cpu: %s (%s)", purpose, exc)
            _optional_logged.add(purpose)
    if _optional is False:
        if purpose not in _optional_logged:
            _optional_logged.add(purpose)
            logger.info("cpu: %s (%s)", purpose, _error or "cpu kernels unavailable")
    return _optional
