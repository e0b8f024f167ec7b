"""The hpu worker: one Gaudi device, HPU graphs unless enforce_eager, every bucket warmed up.

With a CPU torch device (the backend emulated on the host in tests) the same code runs without
habana_frameworks: mark_step and graph wrapping do nothing there (habana.py).
"""
from __future__ import annotations

import logging

import torch

from pagedllm import envs
from pagedllm.backends.hpu import habana
from pagedllm.backends.hpu.buckets import HpuBuckets
from pagedllm.backends.hpu.model_runner import HpuModelRunner
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

WARMUP_ENV = "PAGEDLLM_HPU_WARMUP"  # "0": skip the warm-up (graphs build on first use)


class HpuWorker(Worker):
    runner: HpuModelRunner | None

    def select_device(self) -> torch.device:
        if self.backend.torch_device == "hpu":
            import habana_frameworks.torch  # noqa: F401  (registers the "hpu" device)
        return torch.device(self.backend.torch_device)

    def load_model(self) -> None:
        super().load_model()
        assert self.model is not None
        cfg = self.config
        buckets = HpuBuckets.from_limits(cfg.scheduler.max_num_seqs,
                                         cfg.scheduler.max_num_batched_tokens,
                                         cfg.model.max_model_len, cfg.cache.block_size)
        # HPU graphs only on a Gaudi (on a CPU device the wrapper does nothing, and the counters
        # that the conformance suite's graphs claim reads stay at zero)
        graphs = not cfg.enforce_eager and habana.records_graphs(self.device)
        self.runner = HpuModelRunner(self.model, cfg.cache.block_size, self.device,
                                     cfg.model.seed, buckets,
                                     graph_counters=self.counters if graphs else None)
        if graphs:
            self.runner.model = habana.wrap_in_hpu_graph(self.model, self.device)

    def available_kv_bytes(self) -> int:
        """Gaudi: HBM limit * gpu_memory_utilization minus the peak of a full-size step; an
        explicit kv_cache_space_gib (or a CPU device) uses the base rule."""
        if self.config.cache.kv_cache_space_gib is not None or self.device.type != "hpu":
            return super().available_kv_bytes()
        self.profile_run()
        limit, peak = habana.memory_limit_and_peak(self.device)
        return max(0, int(limit * self.config.cache.gpu_memory_utilization) - peak)

    def after_cache_init(self) -> None:
        if not envs.PAGEDLLM_HPU_WARMUP:
            return
        assert self.runner is not None
        cfg = self.config
        count, seconds = self.runner.warm_up(
            self.kv_caches, cfg.scheduler.max_num_batched_tokens,
            -(-cfg.model.max_model_len // cfg.cache.block_size))
        logger.info("hpu warm-up ran %d buckets in %.1f s", count, seconds)
