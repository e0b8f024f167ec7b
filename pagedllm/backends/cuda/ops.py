"""Python face of the CUDA/ROCm kernels in csrc/ (the `pagedllm._C` extension).

The extension is the installed `pagedllm._C` when present; otherwise the same sources are built on
first use with torch.utils.cpp_extension.load into a cache directory ($PAGEDLLM_CACHE_DIR, default
~/.cache/pagedllm/kernels/<hash of sources + torch version>). Importing this module imports nothing
heavy: torch and the extension are loaded by the first call.

KV-cache layout (per layer): kv_cache [2, num_blocks, block_size, num_kv_heads, head_size];
key_cache = kv_cache[0], value_cache = kv_cache[1]; any layout with a contiguous last dim works.
Layer ops (rms_norm, rotary, silu_and_mul) return new contiguous tensors; their inputs may be
strided views with a contiguous last dim.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

from pagedllm import envs
from pagedllm.backends.kernel_build import PACKAGE_DIR as _PACKAGE_DIR
from pagedllm.backends.kernel_build import build_directory, csrc_dir, jit_load

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module: ModuleType | None = None


def _setup_ext(src: Path) -> ModuleType:
    """csrc/setup_ext.py loaded by path: the one list of sources and compile flags."""
    spec = importlib.util.spec_from_file_location("pagedllm_csrc_setup_ext", src / "setup_ext.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jit_build() -> ModuleType:
    src = csrc_dir()
    if src is None:
        raise RuntimeError(
            "pagedllm._C is not installed and the kernel sources (csrc/) were not found next to "
            f"the package ({_PACKAGE_DIR}); reinstall pagedllm with its csrc package data"
        )
    ext = _setup_ext(src)
    device = ext.target_device()
    if device == "cpu":
        raise RuntimeError(
            "cannot build the pagedllm GPU kernels: torch has no CUDA/HIP support or no nvcc/hipcc "
            "was found (set CUDA_HOME or ROCM_HOME), or PAGEDLLM_TARGET_DEVICE=cpu"
        )
    ext.ensure_default_arch(device)
    sources = ext.kernel_sources(src)
    flags = ext.compile_args(device)
    build_dir = build_directory(sources + ext.kernel_headers(src), device, flags)
    logger.debug("loading the pagedllm %s kernels from %s", device, build_dir)
    return jit_load(
        "pagedllm_C",
        sources,
        build_dir,
        build_time="minutes",
        extra_cflags=flags["cxx"],
        extra_cuda_cflags=flags["nvcc"],
        extra_include_paths=[str(src)],
        verbose=envs.PAGEDLLM_VERBOSE_BUILD,
    )


def load_kernels() -> ModuleType:
    """The kernel module: installed pagedllm._C, else JIT-built. Raises RuntimeError with the reason."""
    global _module
    with _lock:
        if _module is None:
            try:
                from pagedllm import _C  # type: ignore[attr-defined]

                _module = _C
            except ImportError:
                _module = _jit_build()
            _configure_launch(_module)
        return _module


def _configure_launch(module: ModuleType) -> None:
    """Programmatic dependent launch for the kernels (sm_90+; see csrc/cuda_compat.h), unless
    PAGEDLLM_PROGRAMMATIC_LAUNCH=0. The probe runs one kernel on the current device."""
    import torch

    enable = envs.PAGEDLLM_PROGRAMMATIC_LAUNCH
    if enable and torch.cuda.is_available():
        on = module.configure_programmatic_launch(True)
        logger.debug("programmatic dependent launch: %s", "on" if on else "off (before sm_90)")
    else:
        module.configure_programmatic_launch(False)


def kernels_available(build: bool = False) -> tuple[bool, str]:
    """(ok, reason); never raises. build=True also loads (and if needed compiles) the kernels."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return False, f"torch is not importable: {exc}"
    try:
        if not (torch.version.cuda or torch.version.hip):
            return False, f"torch {torch.__version__} was built without CUDA or ROCm support"
        if not torch.cuda.is_available():
            return False, "no CUDA/ROCm device is visible (torch.cuda.is_available() is False)"
        if _module is not None:
            return True, "kernels loaded"
        if build:
            load_kernels()
            return True, "kernels loaded"
        if importlib.util.find_spec("pagedllm._C") is not None:
            return True, "pagedllm._C is installed"
        src = csrc_dir()
        if src is None:
            return False, "pagedllm._C is not installed and the csrc/ kernel sources are missing"
        device = _setup_ext(src).target_device()
        if device == "cpu":
            return False, "pagedllm._C is not installed and no nvcc/hipcc was found to build it"
        return True, f"kernels will be JIT-built for {device} on first use"
    except Exception as exc:  # noqa: BLE001 - the contract is to report, not raise
        return False, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------
# Ops. Shapes: query/out [num_seqs, num_heads, head_size]; caches [num_blocks, block_size,
# num_kv_heads, head_size]; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.
# ---------------------------------------------------------------------------------------------


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    partition_size: int | None = None,
    num_warps: int = 0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context; fills and returns out.

    ``sliding_window``: the query (position seq_len - 1) sees only the last ``sliding_window``
    tokens; ``soft_cap``: logits become cap * tanh(logit / cap) (None: off, both).

    max_seq_len must be >= every seq_len (longer sequences are truncated). Each thread block takes
    ``partition_size`` tokens of one sequence (a power of two in [MIN_PARTITION_SIZE,
    MAX_PARTITION_SIZE]; None: ``decode_partition_size``, which shortens partitions when there are
    few sequences); contexts longer than one partition use float32 scratch buffers allocated here.
    ``num_warps`` 0 lets the kernel pick its thread-block width per launch (csrc/ops.h
    paged_attention_narrow_blocks); 2 or 4 forces one.
    """
    import torch

    from pagedllm.backends.cuda.checks import check_paged_attention

    check_paged_attention(out, query, key_cache, value_cache, int(num_kv_heads), block_tables,
                          seq_lens, int(block_size))
    kernels = load_kernels()
    num_seqs, num_heads, _ = query.shape
    if partition_size is None:
        partition_size = kernels.decode_partition_size(num_seqs, num_heads, int(num_kv_heads),
                                                       int(max_seq_len))
    lo, hi = int(kernels.MIN_PARTITION_SIZE), int(kernels.MAX_PARTITION_SIZE)
    if not (lo <= partition_size <= hi and partition_size & (partition_size - 1) == 0):
        raise ValueError(f"partition_size={partition_size} must be a power of two in [{lo}, {hi}]")
    if num_warps not in (0, 2, 4):
        raise ValueError(f"num_warps={num_warps} must be 0 (chosen per launch), 2 or 4")
    num_partitions = max(1, (int(max_seq_len) + partition_size - 1) // partition_size)
    tmp_out = exp_sums = max_logits = None
    if num_partitions > 1:
        head_size = query.shape[2]
        f32 = dict(dtype=torch.float32, device=query.device)
        tmp_out = torch.empty(num_seqs, num_heads, num_partitions, head_size, **f32)
        exp_sums = torch.empty(num_seqs, num_heads, num_partitions, **f32)
        max_logits = torch.empty(num_seqs, num_heads, num_partitions, **f32)
    kernels.paged_attention(
        out, query, key_cache, value_cache, int(num_kv_heads), float(scale), block_tables,
        seq_lens, int(block_size), int(max_seq_len), tmp_out, exp_sums, max_logits,
        int(partition_size), int(num_warps), int(sliding_window or 0), float(soft_cap or 0.0),
    )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_size] at slot_mapping [num_tokens] (int64).

    slot = block * block_size + offset; negative slots (padding) and slots past the cache are skipped.
    """
    from pagedllm.backends.cuda.checks import check_reshape_and_cache

    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    load_kernels().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy block src -> dst in every layer's caches; block_mapping [num_pairs, 2] int64 (CPU or GPU)."""
    from pagedllm.backends.cuda.checks import check_block_mapping, check_layer_caches

    check_layer_caches(list(key_caches), list(value_caches))
    n = key_caches[0].shape[0] if key_caches else 0
    check_block_mapping(block_mapping, n, n)
    load_kernels().copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between a GPU cache and a CPU cache (pin it for asynchronous copies).

    src/dst: [num_blocks, ...] with each block contiguous; block_mapping [num_pairs, 2] int64 on CPU.
    Enqueued on the current stream of the GPU side.
    """
    from pagedllm.backends.cuda.checks import KernelArgumentError, check_block_mapping

    if block_mapping.device.type != "cpu":
        raise KernelArgumentError("block_mapping for swap_blocks must be on the CPU")
    check_block_mapping(block_mapping, src.shape[0], dst.shape[0])
    if src.dtype != dst.dtype:
        raise KernelArgumentError(f"swap_blocks: src dtype {src.dtype} != dst dtype {dst.dtype}")
    if src.shape[1:] != dst.shape[1:]:
        raise KernelArgumentError(f"swap_blocks: block shape {list(src.shape[1:])} of src differs "
                                  f"from dst {list(dst.shape[1:])}")
    if (src.device.type == "cuda") == (dst.device.type == "cuda"):
        raise KernelArgumentError("swap_blocks: exactly one of src and dst must be a CUDA tensor")
    load_kernels().swap_blocks(src, dst, block_mapping)


# ---------------------------------------------------------------------------------------------
# Layer ops (csrc/layer_kernels.cu): the model ops of pagedllm/models/layers/ops.py in one launch
# each, with the reference's rounding points (bit-identical in float16/bfloat16 except rms_norm,
# within one ulp of the dtype). The engine reaches them through layer_ops.py, which skips these
# Python checks; the C++ binding checks again.
# ---------------------------------------------------------------------------------------------


def _check_input(x: torch.Tensor, shape_doc: str, dims: int) -> None:
    from pagedllm.backends.cuda.checks import KernelArgumentError, check_float

    if x.device.type != "cuda":
        raise KernelArgumentError(f"x must be a CUDA tensor, got device {x.device}")
    check_float(x, "x")
    if x.dim() != dims:
        raise KernelArgumentError(f"x must be {shape_doc}, got shape {list(x.shape)}")
    if x.stride(-1) != 1:
        raise KernelArgumentError(f"x must be contiguous in its last dimension, got strides "
                                  f"{list(x.stride())}")


def _check_operand(t: torch.Tensor, name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    from pagedllm.backends.cuda.checks import KernelArgumentError, check_device, check_float

    check_device(t, name, x.device)
    check_float(t, name, x.dtype)
    if tuple(t.shape) != shape:
        raise KernelArgumentError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.stride(-1) != 1:
        raise KernelArgumentError(f"{name} must be contiguous in its last dimension")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for x [num_tokens, hidden_size], weight [hidden_size].

    h = x + residual [num_tokens, hidden_size] rounded to the dtype (new_residual, a new tensor), or
    x itself without residual; normed = weight * round(h * rsqrt(mean(h^2) + eps)).
    """
    from pagedllm.backends.cuda.checks import KernelArgumentError

    _check_input(x, "[num_tokens, hidden_size]", 2)
    _check_operand(weight, "weight", x, (x.shape[1],))
    if residual is not None:
        _check_operand(residual, "residual", x, tuple(x.shape))
    if not (eps >= 0 and math.isfinite(eps)):
        raise KernelArgumentError(f"eps must be finite and >= 0, got {eps}")
    return load_kernels().rms_norm(x, weight, float(eps), residual)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding of x [num_tokens, num_heads, head_size] (e.g. a view into the qkv
    projection) with cos/sin [num_tokens, head_size]; returns a contiguous tensor of x's shape."""
    from pagedllm.backends.cuda.checks import KernelArgumentError

    _check_input(x, "[num_tokens, num_heads, head_size]", 3)
    if x.shape[2] % 2:
        raise KernelArgumentError(f"x must have an even head_size, got {x.shape[2]}")
    _check_operand(cos, "cos", x, (x.shape[0], x.shape[2]))
    _check_operand(sin, "sin", x, (x.shape[0], x.shape[2]))
    return load_kernels().rotary(x, cos, sin)


def rotary_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> None:
    """``rotary`` of the q and k heads of qkv [num_tokens, (num_heads + 2 * num_kv_heads) *
    head_size] (a projection's output: q heads, k heads, v heads) in place, and the rotated k and
    the v of each token written into the caches at slot_mapping (as ``reshape_and_cache``; negative
    slots are padding). num_kv_heads and head_size are the caches'."""
    from pagedllm.backends.cuda.checks import KernelArgumentError, check_reshape_and_cache

    _check_input(qkv, "[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]", 2)
    if key_cache.dim() != 4:
        raise KernelArgumentError(f"key_cache must be [num_blocks, block_size, num_kv_heads, "
                                  f"head_size], got shape {list(key_cache.shape)}")
    t = qkv.shape[0]
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    if num_heads <= 0 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_size:
        raise KernelArgumentError(
            f"qkv must have (num_heads + 2 * num_kv_heads) * head_size = "
            f"{(max(num_heads, 0) + 2 * num_kv_heads) * head_size} columns for num_heads="
            f"{num_heads} and the cache's {num_kv_heads} x {head_size}, got {list(qkv.shape)}")
    if head_size % 2:
        raise KernelArgumentError(f"the cache's head_size must be even, got {head_size}")
    _check_operand(cos, "cos", qkv, (t, head_size))
    _check_operand(sin, "sin", qkv, (t, head_size))
    kv = qkv.view(t, -1, head_size)[:, num_heads:]
    check_reshape_and_cache(kv[:, :num_kv_heads], kv[:, num_kv_heads:], key_cache, value_cache,
                            slot_mapping)
    load_kernels().rotary_and_cache(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                    int(num_heads))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * I] (gate, then up) -> silu(gate) * up [num_tokens, I]."""
    from pagedllm.backends.cuda.checks import KernelArgumentError

    _check_input(x, "[num_tokens, 2 * intermediate_size]", 2)
    if x.shape[1] % 2:
        raise KernelArgumentError(f"x must have an even last dimension (gate, then up), got "
                                  f"{x.shape[1]}")
    return load_kernels().silu_and_mul(x)
