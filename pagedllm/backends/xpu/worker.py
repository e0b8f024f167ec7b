"""The xpu worker: one Intel GPU per rank, the KV cache sized by profiling a full-size step."""
from __future__ import annotations

import logging

import torch

from pagedllm.worker.worker import GiB, Worker

logger = logging.getLogger(__name__)


class XpuWorker(Worker):
    def select_device(self) -> torch.device:
        import intel_extension_for_pytorch  # noqa: F401  (registers IPEX's XPU kernels)

        device = torch.device("xpu", self.tp.rank % max(1, torch.xpu.device_count()))
        torch.xpu.set_device(device)
        return device

    def available_kv_bytes(self) -> int:
        """total * gpu_memory_utilization minus the weights and the activation peak of a
        full-size step; an explicit kv_cache_space_gib wins."""
        if self.config.cache.kv_cache_space_gib is not None:
            return super().available_kv_bytes()
        torch.xpu.empty_cache()
        torch.xpu.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.xpu.synchronize(self.device)
        peak = torch.xpu.max_memory_allocated(self.device)
        total = torch.xpu.get_device_properties(self.device).total_memory
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        torch.xpu.empty_cache()
        logger.info("KV cache budget %.2f GiB (total %.1f GiB, peak %.2f GiB)", budget / GiB,
                    total / GiB, peak / GiB)
        return max(0, budget)
