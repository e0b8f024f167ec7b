"""The tpu backend: torch_xla on a TPU (PJRT), static shapes, no swap to host.

Every step is padded to a power-of-two bucket of (tokens, logit rows, block-table width) and the
worker compiles every bucket before the first request (buckets.py, worker.py). Attention runs
torch_xla's ragged paged-attention Pallas kernel on a TPU and a static-shape gather elsewhere
(attention.py). There is no swap to host: the scheduler preempts by recompute.

XLA on the host CPU (``PJRT_DEVICE=CPU``) compiles and runs the same programs, which is how this
backend is tested without a TPU. It is opt-in (``PAGEDLLM_TPU_ALLOW_CPU=1``), so that
``--device auto`` on a machine that merely has torch_xla installed never picks XLA-on-CPU over
the cpu backend. torch_xla is imported only when the backend is probed or used.
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.contract.backend import Backend
from pagedllm.contract.cache_ops import CacheOps
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.attention import AttentionImpl
    from pagedllm.reference.ops import Ops

ALLOW_CPU_ENV = "PAGEDLLM_TPU_ALLOW_CPU"
INSTALL_HINT = "pip install torch-xla; on a TPU VM: pip install 'torch-xla[tpu]'"


def _cpu_allowed() -> bool:
    return envs.PAGEDLLM_TPU_ALLOW_CPU


class TpuBackend(Backend):
    name = "tpu"
    torch_device = "xla"
    dist_backend = "xla"
    default_dtype = "bfloat16"
    capabilities = Capabilities(graphs=False, swap=False, static_shapes=True,
                                # 16 and 32: the tiny models of tests/backends/test_tpu.py
                                head_sizes=(16, 32, 64, 80, 96, 112, 128, 256), max_gqa_group=8,
                                prefix_caching=True, chunked_prefill=True,
                                dtypes=("bfloat16", "float32"), preferred_block_size=16,
                                block_sizes=(16, 32, 64, 128), max_tensor_parallel_size=1,
                                attention_features=("sliding_window", "logits_soft_cap"))
    worker_class = "pagedllm.backends.tpu.worker:TpuWorker"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_xla") is None:
            return False, f"torch_xla is not installed; {INSTALL_HINT}"
        pjrt = os.environ.get("PJRT_DEVICE", "").upper()
        if not pjrt and importlib.util.find_spec("libtpu") is None:
            return False, ("no TPU runtime: libtpu is not installed and PJRT_DEVICE is not set "
                           f"(on a TPU VM: {INSTALL_HINT}; to run the XLA path on the host CPU "
                           f"for testing: PJRT_DEVICE=CPU {ALLOW_CPU_ENV}=1)")
        if pjrt == "CPU" and not _cpu_allowed():
            return False, (f"PJRT_DEVICE=CPU is XLA on the host CPU, not a TPU; set "
                           f"{ALLOW_CPU_ENV}=1 to run the tpu backend there anyway (testing)")
        try:
            import torch_xla
            import torch_xla.runtime as xr

            kind = xr.device_type()
            if kind == "TPU":
                count = xr.global_runtime_device_count()
                return True, f"{count} TPU device(s) via PJRT, torch_xla {torch_xla.__version__}"
            if kind == "CPU" and _cpu_allowed():
                torch_xla.device()  # initializes the PJRT CPU client: fails here, not later
                return True, (f"XLA on the host CPU (PJRT_DEVICE=CPU, {ALLOW_CPU_ENV}=1; for "
                              f"testing: the Pallas kernel is replaced by a gather), torch_xla "
                              f"{torch_xla.__version__}")
            return False, (f"PJRT device is {kind or 'unset'}, not TPU (set PJRT_DEVICE=TPU on a "
                           f"TPU VM, or PJRT_DEVICE=CPU {ALLOW_CPU_ENV}=1 for testing)")
        except Exception as exc:  # a broken runtime must not break the backend table
            return False, f"torch_xla failed to initialize: {type(exc).__name__}: {exc}"

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "xla"
        if choice != "xla":
            raise ValueError(f"attention_backend={choice!r} is not available on tpu; allowed: xla")
        from pagedllm.backends.tpu.attention import XlaPagedAttention

        return XlaPagedAttention

    def register_ops(self, ops: Ops) -> None:
        from pagedllm.backends.tpu import ops as tpu_ops

        ops.register("linear", tpu_ops.linear)
        from pagedllm.reference.moe import fused_moe_dense

        ops.register("fused_moe", fused_moe_dense)  # static shapes for XLA

    def cache_ops(self) -> CacheOps:
        from pagedllm.backends.tpu.cache_ops import XlaCacheOps

        return XlaCacheOps()

    def synchronize(self) -> None:
        import torch_xla

        torch_xla.sync()
