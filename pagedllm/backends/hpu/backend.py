"""The hpu backend: Intel Gaudi through habana_frameworks.torch (lazy mode, HPU graphs).

Steps are padded to buckets over batch size and prompt length (prefill) or flattened-block
count (decode) and every bucket is warmed up before serving (buckets.py, model_runner.py).
Decode attention runs over a flattened block list (flat_attention.py). Only habana.py touches
the SDK; the rest is plain torch and is tested on the CPU. Block size 128 (Gaudi's tile), and
no prefill over cached context: prefix caching and chunked prefill are declared off.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.backends.hpu import habana
from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.attention import AttentionImpl

logger = logging.getLogger(__name__)

HPU_BLOCK_SIZE = 128
ENGINE_DEFAULT_BLOCK_SIZE = 16  # EngineArgs' default: taken to mean "not chosen"


class HpuBackend(Backend):
    name = "hpu"
    torch_device = "hpu"
    dist_backend = "hccl"
    default_dtype = "bfloat16"
    capabilities = Capabilities(graphs=True, swap=True, static_shapes=True, prefix_caching=False,
                                chunked_prefill=False, dtypes=("bfloat16", "float32"),
                                preferred_block_size=HPU_BLOCK_SIZE,
                                block_sizes=(HPU_BLOCK_SIZE,), max_tensor_parallel_size=1,
                                # flat_attention.py is plain torch (any head size); these are
                                # the sizes of real models and of the tests' tiny ones
                                head_sizes=(16, 32, 40, 64, 72, 80, 96, 112, 128, 192, 256))
    worker_class = "pagedllm.backends.hpu.worker:HpuWorker"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not habana.is_installed():
            return False, f"habana_frameworks is not installed; {habana.INSTALL_HINT}"
        try:
            count = habana.device_count()
        except Exception as exc:  # a broken driver must not break the backend table
            return False, f"habana_frameworks failed to initialize: {type(exc).__name__}: {exc}"
        if count == 0:
            return False, "no Gaudi device is visible (habana_frameworks reports 0 HPUs)"
        return True, f"{count} HPU(s): {habana.device_name()}"

    def check_and_update_config(self, config: EngineConfig) -> None:
        if config.cache.block_size == ENGINE_DEFAULT_BLOCK_SIZE:
            logger.info("hpu: block_size %d -> %d (the Gaudi default)",
                        ENGINE_DEFAULT_BLOCK_SIZE, HPU_BLOCK_SIZE)
            config.cache.block_size = HPU_BLOCK_SIZE
        super().check_and_update_config(config)

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "flat"
        if choice != "flat":
            raise ValueError(f"attention_backend={choice!r} is not available on hpu; allowed: flat")
        from pagedllm.backends.hpu.attention import HpuPagedAttention

        return HpuPagedAttention

    def synchronize(self) -> None:
        if self.torch_device == "hpu":
            habana.synchronize()
