"""The cpu backend's C++ kernels (csrc/cpu/), built on first use with the host C++ compiler.

``load_cpu_kernels(*libraries)`` compiles the csrc/cpu/*.cpp of the libraries asked for with
torch.utils.cpp_extension.load (once) into the shared kernel cache
(pagedllm/backends/kernel_build.py: $PAGEDLLM_CACHE_DIR, default
~/.cache/pagedllm/kernels/<hash of torch version, sources and flags>); later processes load the
cached libraries. Six libraries (``LIBRARIES``), each built for its own ISA and only when asked
for, so a first run builds what it uses: every model runs ``CORE`` (the attention and the layer
ops); the quantized routes, thread binding and the MoE op load theirs on first use. Libraries
missing from the cache are built at the same time (one compiler per source file, up to ninja's
job count each). The attention (paged_attention_cpu.cpp: decode, prefill_attention_cpu.cpp:
prefill; shared checks in attention_args.h, vector helpers in attention_vec.h) is written for
AVX2; the layer ops, the greedy sampler and guided decoding's token mask (layer_ops_cpu.cpp,
sampling_cpu.cpp, bitmask_cpu.cpp) and the other libraries follow torch's own CPU kernels
(AVX-512 where torch runs AVX-512), so that their vectorized exp and log are torch's and bf16/fp16
convert 16 lanes at a time. All register with torch's dispatcher as ``torch.ops.pagedllm_cpu.*``,
and that namespace is what ``load_cpu_kernels()`` returns.

A library whose build fails (no compiler, no ninja, ...) is not retried in the same process:
every later call that asks for it raises the same RuntimeError at once. ``PAGEDLLM_CPU_KERNELS=0``
turns the kernels off (then ``load_cpu_kernels()`` raises saying so).
Importing this module imports nothing heavy.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.backends.kernel_build import build_directory, csrc_dir, jit_load

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGEDLLM_CPU_KERNELS"
ATTENTION = "pagedllm_cpu"
LAYERS = "pagedllm_cpu_layers"
QUANT = "pagedllm_cpu_quant"
THREADS = "pagedllm_cpu_threads"
MOE = "pagedllm_cpu_moe"
FEW_ROWS = "pagedllm_cpu_few_rows"
CORE = (ATTENTION, LAYERS)  # what every model runs on the native attention
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
    # linears of proposers at 1..8 rows (backends/cpu/few_rows.py)
    "pagedllm_cpu_few_rows": (("few_rows_linear_cpu.cpp",), "torch"),
}
# headers the sources include: hashed into every library's build directory name (not compiled)
HEADERS = ("attention_args.h", "attention_vec.h", "vec_math.h")
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
           "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
_lock = threading.Lock()
_loaded: set[str] = set()  # libraries loaded into this process
_errors: dict[str, str] = {}  # library -> why it did not build or load (not retried)


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


def _load_one(name: str) -> None:
    """Load ``name`` from the kernel cache, building it there first where it is missing."""
    src = csrc_dir()
    if src is None:
        raise RuntimeError("the csrc/cpu kernel sources were not found next to the package; "
                           "reinstall pagedllm with its csrc package data")
    sources = [str(src / "cpu" / f) for f in LIBRARIES[name][0]]
    flags = compile_flags(name)
    build_dir = library_build_dir(name)
    logger.debug("loading %s from %s", name, build_dir)
    jit_load(name, sources, build_dir, is_python_module=False,
             build_time=f"~{16 * len(sources)} CPU-seconds, {len(sources)} source file(s)",
             extra_cflags=flags, extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
             verbose=envs.PAGEDLLM_VERBOSE_BUILD)


def _load(names: list[str]) -> None:
    """Load ``names`` (keys of LIBRARIES, none loaded yet), building the missing ones at the same
    time; records each failure in ``_errors``. Caller holds ``_lock``."""

    def attempt(name: str) -> Exception | None:
        try:
            _load_one(name)
            return None
        except Exception as exc:  # noqa: BLE001 - compiler, ninja and loader errors vary
            return exc

    if len(names) == 1:
        outcomes = [attempt(names[0])]
    else:  # each build is a ninja subprocess: threads overlap them
        with ThreadPoolExecutor(len(names), thread_name_prefix="pagedllm-cpu-build") as pool:
            outcomes = list(pool.map(attempt, names))
    for name, exc in zip(names, outcomes):
        if exc is None:
            _loaded.add(name)
        else:
            _errors[name] = (f"cannot build the pagedllm cpu kernels (csrc/cpu, {name}): "
                             f"{type(exc).__name__}: {exc}")


def load_cpu_kernels(*libraries: str) -> Any:
    """``torch.ops.pagedllm_cpu`` with ``libraries`` (keys of LIBRARIES; none given: all of them)
    loaded, building those missing from the kernel cache on first use; thread-safe, one build
    per library and process. Raises RuntimeError with the reason when the kernels are disabled
    or one of the libraries cannot be built."""
    if cpu_kernels_disabled():
        raise RuntimeError(f"the cpu kernels are disabled by {ENABLE_ENV}=0")
    wanted = list(libraries or LIBRARIES)
    unknown = [name for name in wanted if name not in LIBRARIES]
    if unknown:
        raise ValueError(f"unknown cpu kernel library {unknown}; known: {', '.join(LIBRARIES)}")
    with _lock:
        missing = [n for n in dict.fromkeys(wanted) if n not in _loaded and n not in _errors]
        if missing:
            _load(missing)
        failed = [_errors[n] for n in wanted if n in _errors]
        if failed:
            raise RuntimeError(failed[0])
    import torch

    return torch.ops.pagedllm_cpu


def loaded_libraries() -> frozenset[str]:
    """The libraries loaded into this process so far."""
    return frozenset(_loaded)


_optional: dict[str, Any] = {}  # library -> load_cpu_kernels(library), or False where it raised
_optional_logged: set[str] = set()


def optional_cpu_kernels(purpose: str, library: str) -> Any:
    """``torch.ops.pagedllm_cpu`` with ``library`` loaded, for a fast path that has a torch
    fallback, or False where it does not load (memoized: hot paths call this per op; the reason
    is logged once per ``purpose``, which names the fallback)."""
    kernels = _optional.get(library)
    if kernels is None:
        try:
            kernels = load_cpu_kernels(library)
        except RuntimeError as exc:
            kernels = False
            logger.info("cpu: %s (%s)", purpose, exc)
            _optional_logged.add(purpose)
        _optional[library] = kernels
    if kernels is False and purpose not in _optional_logged:
        _optional_logged.add(purpose)
        logger.info("cpu: %s (%s)", purpose, _errors.get(library, "cpu kernels unavailable"))
    return kernels
