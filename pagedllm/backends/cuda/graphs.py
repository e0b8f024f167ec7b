"""CUDA graphs for decode steps: one graph per padded batch size, replayed with static buffers."""
from __future__ import annotations

import bisect
import logging

import torch
from torch import nn

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.core.batch import ScheduledBatch
from pagedllm.worker.model_runner import ModelInput

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's capture list)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured ``model -> logits`` for decode-only batches.

    Static buffers hold the largest batch; a batch of B sequences runs the graph captured for the
    smallest size >= B, with the extra rows padded (slot -1, so nothing is written; context 1).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, sizes: list[int], device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sizes
        max_b = sizes[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.slots = torch.full((max_b,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_b, width), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _metadata(self, b: int) -> AttentionMetadata:
        empty = self.seq_lens[:0]
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            slot_mapping=self.slots[:b], block_size=self.block_size,
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.seq_lens.device),
            prefill_seq_lens=empty, prefill_context_lens=empty,
            prefill_block_tables=self.block_tables[:0], max_prefill_query_len=0,
            max_prefill_seq_len=0, decode_seq_lens=self.seq_lens[:b],
            decode_block_tables=self.block_tables[:b], max_decode_seq_len=self.max_model_len,
            extras={"graph_max_seq_len": self.max_model_len})

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metadata(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (0 < len(batch.seqs) <= self.sizes[-1]
                and all(s.num_tokens == 1 and s.num_samples >= 1 and not s.prompt_logprob_targets
                        for s in batch.seqs))

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Logits [B, vocab] for a decode-only input prepared by the model runner."""
        b = inp.metadata.num_decode_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        meta = inp.metadata
        self.input_ids[:b].copy_(inp.input_ids, non_blocking=True)
        self.positions[:b].copy_(inp.positions, non_blocking=True)
        self.slots[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.decode_seq_lens, non_blocking=True)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.decode_block_tables, non_blocking=True)
        if size > b:
            self.slots[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[size][:b]
