"""The cuda backend with its device code run on the CPU: the ``cuda-emu`` conformance leg.

``CudaEmuBackend`` is the cuda backend (it subclasses ``CudaBackend``: the same capabilities,
the same ``check_and_update_config``, the same ``CudaPagedAttention`` and ``KernelCacheOps``
code) with the calls into ``pagedllm.backends.cuda.ops`` routed to the csrc/ launchers compiled
for the CPU by the SIMT emulator (tests/kernels/emu_ops.py), and the Triton kernels (prefill over
cached context, greedy sampling, the token bitmask, fused MoE) run by Triton's interpreter
(TRITON_INTERPRET=1). Tensors live on the CPU; nothing else changes, so the conformance sweep
over this backend proves the cuda backend's kernel-level declarations (head sizes, GQA groups,
block sizes, features, dtypes) on a machine without a GPU.

What it cannot prove: the engine-level claims (CUDA graphs, asynchronous output, tensor
parallel, end-to-end equality through the cuda worker) need a GPU; ``conformance_kernels_only``
tells the conformance plugin to report those checks as skipped, with this reason.
Registered for the leg only (.ci/leg_cuda_emu.sh puts an entry point on PYTHONPATH).
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.backends import PLUGIN_API_VERSION
from pagedllm.backends.cuda.attention import CudaPagedAttention
from pagedllm.backends.cuda.backend import CudaBackend
from pagedllm.backends.cuda.cache_ops import KernelCacheOps

if TYPE_CHECKING:
    from pagedllm.backends.attention import AttentionImpl
    from pagedllm.backends.interface import CacheOps
    from pagedllm.config import EngineConfig
    from pagedllm.models.layers.ops import Ops
    from pagedllm.worker.worker import Worker

# tests/kernels holds emu_ops.py (the emulated launchers behind cuda.ops' Python signatures)
KERNELS_DIR = Path(__file__).resolve().parents[3] / "kernels"


def emu_ops() -> types.ModuleType:
    """tests/kernels/emu_ops.py, imported by its plain name as the kernel tests import it."""
    if str(KERNELS_DIR) not in sys.path:
        sys.path.insert(0, str(KERNELS_DIR))
    import emu_ops as emu

    return emu


def _kernels_namespace() -> types.SimpleNamespace:
    """What cuda/attention.py and cuda/cache_ops.py call as ``ops.*``, on the emulator.
    ``load_kernels()`` returns the emulator module, which has the extension's rotary_and_cache."""
    emu = emu_ops()
    return types.SimpleNamespace(paged_attention=emu.paged_attention,
                                 reshape_and_cache=emu.reshape_and_cache,
                                 copy_blocks=emu.copy_blocks, swap_blocks=emu.swap_blocks,
                                 load_kernels=lambda: emu)


def rebound(fn: Callable[..., Any], **names: Any) -> Callable[..., Any]:
    """``fn``'s own code with some of its module globals replaced (here: ``ops``), so the cuda
    backend's methods run unchanged while their kernel calls reach the emulator."""
    new = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__doc__ = fn.__kwdefaults__, fn.__doc__
    return new


class _LazyOps:
    """Resolves the emulator on first use (building it takes ~20 s once, cached on disk)."""

    _ns: types.SimpleNamespace | None = None

    def __getattr__(self, name: str) -> Any:
        if _LazyOps._ns is None:
            _LazyOps._ns = _kernels_namespace()
        return getattr(_LazyOps._ns, name)


EMU = _LazyOps()


def _moe_except_bf16(kernel: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """cuda's Triton fused_moe, except for bfloat16 inputs (the reference; see register_ops)."""
    import torch

    from pagedllm.models.layers import moe_ops

    fn = moe_ops.fused_moe if x.dtype == torch.bfloat16 else kernel
    return fn(x, *args, **kwargs)


class EmuPagedAttention(CudaPagedAttention):
    """CudaPagedAttention's methods, their ``ops`` being the emulated launchers."""

    supported_features = CudaPagedAttention.supported_features

    write_kv = rebound(CudaPagedAttention.write_kv, ops=EMU)
    forward_rotary = rebound(CudaPagedAttention.forward_rotary, ops=EMU)
    decode = rebound(CudaPagedAttention.decode, ops=EMU)
    # prefill: cuda's Triton kernel as is (run by Triton's interpreter on CPU tensors)


class EmuCacheOps(KernelCacheOps):
    copy_blocks = rebound(KernelCacheOps.copy_blocks, ops=EMU)
    swap_blocks = rebound(KernelCacheOps.swap_blocks, ops=EMU)


class CudaEmuBackend(CudaBackend):
    name = "cuda-emu"
    torch_device = "cpu"
    dist_backend = "gloo"
    plugin_api_version = PLUGIN_API_VERSION
    # capabilities: inherited from CudaBackend unchanged (what this leg proves)
    conformance_kernels_only: ClassVar[str] = (
        "cuda-emu runs the cuda kernels on the CPU through the SIMT emulator and Triton's "
        "interpreter; CUDA graphs, async output and the cuda worker need a GPU (the H200 run)")
    # cuda's quantized linears (csrc/quantization's int4 GEMV/GEMM, FP8 on torch._scaled_mm)
    # are not routed to an emulator here: their checks would only test the reference
    conformance_not_covered: ClassVar[dict[str, str]] = {
        "test_quant_linear": "cuda's quantized linears (csrc/quantization int4 kernels, FP8 "
                             "torch._scaled_mm) are not emulated in this leg; the GPU run and "
                             "tests/kernels/test_quant_kernels.py cover them"}

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if shutil.which("g++") is None:
            return False, "g++ not found (it compiles csrc/ for the SIMT emulator)"
        if not (KERNELS_DIR / "emu_ops.py").is_file():
            return False, f"{KERNELS_DIR}/emu_ops.py not found (run from a pagedllm checkout)"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False, "TRITON_INTERPRET=1 is not set (the Triton kernels run interpreted)"
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return False, f"triton is not importable: {exc}"
        return True, "cuda kernels on the CPU (SIMT emulator, Triton interpreter)"

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        cls = super().attention_cls(config)
        return EmuPagedAttention if cls is CudaPagedAttention else cls

    def register_ops(self, ops: Ops) -> None:
        """cuda's Triton ops (interpreted) and its csrc/ layer kernels (emulated); the quantized
        linears keep the reference (cuda's FP8 path is torch._scaled_mm, a GPU op)."""
        from pagedllm.backends.cuda.layer_ops import layer_ops
        from pagedllm.backends.cuda.triton_bitmask import apply_token_bitmask
        from pagedllm.backends.cuda.triton_moe import fused_moe
        from pagedllm.backends.cuda.triton_sampling import greedy_logprobs

        ops.register("greedy_logprobs", greedy_logprobs)
        ops.register("apply_token_bitmask", apply_token_bitmask)
        # Triton's interpreter computes bfloat16 tl.dot wrongly (a 16x16 bf16 dot is off by
        # ~1e10 in triton 3.9; float16/float32 are right), so bf16 MoE keeps the reference here
        # and only the GPU run proves the kernel in bf16
        ops.register("fused_moe", functools.partial(_moe_except_bf16, fused_moe))
        if self.layer_kernels:
            for name, fn in layer_ops(emu_ops()).items():
                ops.register(name, fn)

    def cache_ops(self) -> CacheOps:
        return EmuCacheOps()

    def worker_cls(self) -> type[Worker]:
        from pagedllm.worker.worker import Worker

        return Worker  # the engine-level checks are not run (conformance_kernels_only)

    def device_count(self) -> int:
        return 1

    def host_pin_memory(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass
