"""The cuda worker: one GPU, a KV cache sized by profiling, CUDA graphs for decode."""
from __future__ import annotations

import logging

import torch

from pagedllm.backends.cuda.attention import CudaPagedAttention
from pagedllm.backends.cuda.graphs import DecodeGraphs, context_buckets, graph_batch_sizes
from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.spec_decode.graphs import SpecStepGraphs
from pagedllm.worker.pending import PendingOutputs
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

# Decode graphs are captured for contexts up to each of these token counts and up to the model
# length. At large batch sizes each is one kernel partition (no reduce pass); up to 256 tokens the
# kernel also runs its 2-warp thread blocks (csrc/ops.h paged_attention_narrow_blocks).
DECODE_BUCKETS = (256, 512)


class CudaWorker(Worker):
    graphs: DecodeGraphs | None = None
    # with speculative decoding: its runner's steps (decode and verification) instead
    spec_graphs: SpecStepGraphs | None = None

    def select_device(self) -> torch.device:
        # one device per rank of the whole world (pp_rank * tp_size + tp_rank) on one host
        device = torch.device("cuda", self.rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        return device

    def available_kv_bytes(self) -> int:
        """total * gpu_memory_utilization minus the weights, the activation peak of a full-size
        step, and memory held outside torch's allocator (other processes, CUDA context)."""
        if self.config.cache.kv_cache_space_gib is not None:
            return super().available_kv_bytes()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - max(0, outside_torch)
        torch.cuda.empty_cache()
        logger.info("KV cache budget %.2f GiB (total %.1f, torch peak %.2f, outside torch %.2f)",
                    budget / 2**30, total / 2**30, peak / 2**30, outside_torch / 2**30)
        return max(0, budget)

    def after_cache_init(self) -> None:
        if self.config.enforce_eager or self.pp.size > 1:  # a stage's graphs: not yet
            return
        assert self.model is not None
        sizes = graph_batch_sizes(self.config.scheduler.max_num_seqs)
        max_len = self.config.model.max_model_len
        # the csrc/ decode kernel's launch follows the context bucket; torch attention's does not
        shorter = DECODE_BUCKETS if self.attn_cls is CudaPagedAttention else ()
        if self.config.speculative_config is not None:
            self._capture_spec_graphs(sizes, context_buckets(max_len, shorter))
            return
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config.cache.block_size,
                                   max_len, sizes, self.device, context_buckets(max_len, shorter))
        self.graphs.capture()
        self.counters["graph_captures"] += len(self.graphs.graphs)

    def _capture_spec_graphs(self, sizes: list[int], buckets: list[int]) -> None:
        """The speculative runner's decode-only steps at every context bucket: q = 1 at every
        decode size, q = k + 1 (verification) up to MAX_VERIFY_GRAPH_BATCH."""
        from pagedllm.backends.cuda import spec_graphs

        assert self.model is not None
        verify = spec_graphs.verify_graph_sizes(sizes)
        aux = getattr(getattr(self, "proposer", None), "aux_states", None)
        self.spec_graphs = SpecStepGraphs(
            self.model, self.kv_caches, self.config.cache.block_size,
            self.config.model.max_model_len,
            self.config.speculative_config.num_speculative_tokens, sizes, verify, self.device,
            buckets, aux)
        spec_graphs.capture(self.spec_graphs)
        self.counters["graph_captures"] += len(self.spec_graphs.graphs)

    def release_device_memory(self) -> None:
        # the graphs hold the model, the caches and their memory pool
        self.graphs = self.spec_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def run_model(self, batch: ScheduledBatch) -> list[SeqOutput]:
        return self.launch_model(batch).result()

    @torch.inference_mode()
    def launch_model(self, batch: ScheduledBatch) -> PendingOutputs:
        assert self.runner is not None
        if self.graphs is not None and self.graphs.can_run(batch):
            inp = self.runner.prepare(batch)
            self.counters["graph_replays"] += 1
            return self.runner.sample_async(batch, inp, self.graphs.run(inp))
        return self.runner.execute_async(batch, self.kv_caches)
