"""Build description of the `pagedllm._C` extension (CUDA or ROCm).

Used in two places, so the source list and flags live only here:
  * the repository's setup.py: `ext_modules=get_extensions(), cmdclass=get_cmdclass()`;
  * pagedllm/backends/cuda/ops.py, which JIT-builds the same sources when `pagedllm._C` is not
    installed (it loads this file by path).

Target selection: PAGEDLLM_TARGET_DEVICE=cuda|rocm|cpu overrides detection (cpu: no extension).
Otherwise: ROCm when torch was built with HIP and hipcc is found, CUDA when torch was built with CUDA
and nvcc is found, else no extension. GPU architectures come from TORCH_CUDA_ARCH_LIST (CUDA) or
PYTORCH_ROCM_ARCH (ROCm), which torch's cpp_extension honours; on a CUDA build machine without a
visible GPU and without TORCH_CUDA_ARCH_LIST we default to sm_90 (H100/H200).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

CSRC_DIR = Path(__file__).resolve().parent
EXTENSION_NAME = "pagedllm._C"
# The bindings (torch glue) plus the torch-free kernel files.
SOURCE_FILES = (
    "torch_bindings.cpp", "layer_bindings.cpp", "paged_attention.cu", "cache_kernels.cu",
    "layer_kernels.cu", "gemv_kernels.cu", "launch_config.cu", "quant_bindings.cpp",
    "quantization/int4_linear.cu",
)
DEFAULT_CUDA_ARCH = "9.0"
TARGETS = ("cuda", "rocm", "cpu")


def kernel_sources(csrc_dir: Path = CSRC_DIR) -> list[str]:
    """Absolute paths of the extension's sources in `csrc_dir`."""
    return [str(csrc_dir / name) for name in SOURCE_FILES]


def kernel_headers(csrc_dir: Path = CSRC_DIR) -> list[str]:
    """Headers the sources include (part of the JIT cache key)."""
    files = [*csrc_dir.iterdir(), *(csrc_dir / "quantization").iterdir()]
    return sorted(str(p) for p in files if p.suffix in (".h", ".cuh"))


def _has_nvcc() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and Path(CUDA_HOME, "bin", "nvcc").exists()


def _has_hipcc() -> bool:
    from torch.utils.cpp_extension import ROCM_HOME

    return (ROCM_HOME is not None and Path(ROCM_HOME, "bin", "hipcc").exists()) or bool(
        shutil.which("hipcc")
    )


def target_device() -> str:
    """'cuda', 'rocm' or 'cpu' (= build no extension)."""
    forced = os.environ.get("PAGEDLLM_TARGET_DEVICE", "").strip().lower()
    if forced:
        if forced not in TARGETS:
            raise ValueError(f"PAGEDLLM_TARGET_DEVICE={forced!r}; expected one of {', '.join(TARGETS)}")
        return forced
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.version.hip and _has_hipcc():
        return "rocm"
    if torch.version.cuda and _has_nvcc():
        return "cuda"
    return "cpu"


def compile_args(device: str) -> dict[str, list[str]]:
    """extra_compile_args for CUDAExtension: {'cxx': [...], 'nvcc': [...]} (nvcc = hipcc on ROCm)."""
    cxx = ["-O3"]
    gpu = ["-O3"]
    if device == "rocm":
        cxx.append("-DUSE_ROCM")
        gpu.append("-DUSE_ROCM")
    else:
        gpu.append("-lineinfo")
    extra = os.environ.get("PAGEDLLM_KERNEL_FLAGS", "").split()  # e.g. tuning -D overrides
    return {"cxx": cxx + extra, "nvcc": gpu + extra}


def ensure_default_arch(device: str) -> None:
    """Pin sm_90 when building for CUDA with no GPU visible and no TORCH_CUDA_ARCH_LIST set.

    Without it torch would target every architecture it knows (slow) or fail to pick one.
    """
    if device != "cuda" or os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH


def get_extensions() -> list[Any]:
    """[CUDAExtension('pagedllm._C', ...)] when a CUDA/ROCm torch and compiler are present, else []."""
    device = target_device()
    if device == "cpu":
        return []
    import torch
    from torch.utils.cpp_extension import CUDAExtension

    built_for = torch.version.hip if device == "rocm" else torch.version.cuda
    if not built_for:
        raise RuntimeError(
            f"PAGEDLLM_TARGET_DEVICE={device} but torch {torch.__version__} was built without "
            f"{'ROCm' if device == 'rocm' else 'CUDA'}; install a matching torch or use cpu"
        )
    ensure_default_arch(device)
    # setup.py runs from the repository root and wants relative source paths.
    root = CSRC_DIR.parent
    sources = [os.path.relpath(s, root) for s in kernel_sources()]
    return [
        CUDAExtension(
            EXTENSION_NAME,
            sources,
            include_dirs=[str(CSRC_DIR)],
            extra_compile_args=compile_args(device),
        )
    ]


def get_cmdclass() -> dict[str, Any]:
    """{'build_ext': BuildExtension} when there is an extension to build, else {}."""
    if target_device() == "cpu":
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension}
