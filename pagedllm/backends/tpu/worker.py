"""The tpu worker: one XLA device, a KV cache sized from TPU memory, every bucket compiled up
front (warm-up), and a ``torch_xla.sync()`` at each step boundary (model_runner.py)."""
from __future__ import annotations

import logging
import time

import torch

from pagedllm import envs
from pagedllm.backends.tpu.attention import on_tpu
from pagedllm.backends.tpu.buckets import BucketGrid, powers_of_two
from pagedllm.backends.tpu.cache_ops import XlaCacheOps
from pagedllm.backends.tpu.model_runner import TpuModelRunner
from pagedllm.worker.worker import GiB, Worker

logger = logging.getLogger(__name__)

WARMUP_ENV = "PAGEDLLM_TPU_WARMUP"  # "0": compile each bucket on first use instead of up front
# XLA on the host CPU has no allocator statistics: the cache defaults to this much
CPU_DEFAULT_KV_CACHE_GIB = 0.25


class TpuWorker(Worker):
    runner: TpuModelRunner | None
    cache_ops: XlaCacheOps
    pads_verification_steps = True  # TpuModelRunner.forward_rows

    def select_device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def bucket_grid(self) -> BucketGrid:
        """Width buckets on the gather path, whose cost grows with the table width; the TPU
        kernel reads only a sequence's own pages, so there the table has one (full) width.
        Speculative decoding samples 1 + k rows of a verified sequence: row buckets for them."""
        sched, spec = self.config.scheduler, self.config.speculative_config
        return BucketGrid.from_limits(sched.max_num_batched_tokens, sched.max_num_seqs,
                                      self.config.model.max_model_len,
                                      self.config.cache.block_size,
                                      bucket_width=not on_tpu(self.device),
                                      rows_per_seq=1 + (spec.num_speculative_tokens
                                                        if spec is not None else 0))

    def load_model(self) -> None:
        import torch_xla

        super().load_model()
        # materialize the weights now: pending weight-loading ops would otherwise join the
        # first step's program and give it a hash no other step of that shape shares
        torch_xla.sync()
        assert self.model is not None
        self.runner = TpuModelRunner(self.model, self.config.cache.block_size, self.device,
                                     self.config.model.seed, self.bucket_grid(),
                                     self.config.scheduler.max_num_seqs)

    def allocate_device_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        # an inference tensor: steps run under inference_mode, where XLA refuses in-place
        # writes through views of tensors made outside it
        with torch.inference_mode():
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def available_kv_bytes(self) -> int:
        """On a TPU: HBM limit * gpu_memory_utilization minus the peak of a full-size step.
        XLA on the host CPU: CPU_DEFAULT_KV_CACHE_GIB. An explicit kv_cache_space_gib wins."""
        if self.config.cache.kv_cache_space_gib is not None:
            return super().available_kv_bytes()
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return int(CPU_DEFAULT_KV_CACHE_GIB * GiB)
        with torch.inference_mode():  # its throwaway caches must be inference tensors too
            self.profile_run()
        info = xm.get_memory_info(self.device)
        limit = int(info["bytes_limit"])
        peak = int(info.get("peak_bytes_used", info.get("bytes_used", 0)))
        budget = int(limit * self.config.cache.gpu_memory_utilization) - peak
        logger.info("KV cache budget %.2f GiB (HBM %.1f GiB, peak %.2f GiB)", budget / GiB,
                    limit / GiB, peak / GiB)
        return max(0, budget)

    def after_cache_init(self) -> None:
        import torch_xla

        torch_xla.sync()  # materialize the zeroed caches (else the first program builds them)
        assert self.runner is not None
        grid = self.runner.grid
        if not envs.PAGEDLLM_TPU_WARMUP:
            logger.info("tpu warm-up skipped (%s=0): buckets compile on first use; %s",
                        WARMUP_ENV, grid.describe())
            return
        start = time.perf_counter()
        self.runner.warm_up(self.kv_caches)
        with torch.inference_mode():  # the caches are inference tensors
            self.cache_ops.warm_up(self.kv_caches, self.copy_buckets)
        logger.info("tpu warm-up compiled %s, and %d block-copy programs, in %.1f s",
                    grid.describe(), len(self.copy_buckets), time.perf_counter() - start)

    @property
    def copy_buckets(self) -> list[int]:
        """Pair counts of the block-copy programs: a step forks at most max_num_seqs blocks."""
        return powers_of_two(1, self.config.scheduler.max_num_seqs)
