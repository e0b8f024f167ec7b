"""CUDA graphs for decode steps: one graph per padded batch size, replayed with static buffers."""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.contract import layer_fences
from pagedllm.contract.attention import AttentionMetadata
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


def context_buckets(max_model_len: int, shorter: tuple[int, ...] = ()) -> list[int]:
    """Context lengths graphs are captured for: each of ``shorter`` below the model length, and
    the model length. The decode kernel's partitions (and its reduce pass, and its thread-block
    width) follow the captured length, so short buckets keep short contexts from launching
    thread blocks for tokens they do not have."""
    return sorted({n for n in shorter if n < max_model_len} | {max_model_len})


def capture_graph(forward: Callable[[], object], pool: object,
                  stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """``forward`` run twice on ``stream`` (warm-up: allocations and kernel selection happen
    outside the graph), then captured into a graph that draws on ``pool``."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = FencedGraph()
    with torch.cuda.graph(graph, pool=pool):
        forward()
    return graph


class FencedGraph(torch.cuda.CUDAGraph):
    """A graph whose replay first runs the layer-wise waits of imports still pending
    (contract/layer_fences.py): the attention's Python code, which runs them, is not replayed."""

    def replay(self) -> None:
        layer_fences.consume_all()
        super().replay()


class DecodeGraphs:
    """Captured ``model -> logits`` for decode-only batches.

    Static buffers hold the largest batch; a batch of B sequences runs the graph captured for the
    smallest size >= B, with the extra rows padded (slot -1, so nothing is written; context 1),
    and for the smallest context bucket >= its longest sequence.
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, sizes: list[int], device: torch.device,
                 context_lens: list[int] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sizes
        self.context_lens = context_lens or [max_model_len]
        max_b = sizes[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.slots = torch.full((max_b,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_b, width), dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch, context bucket)
        # every graph writes its logits into rows [:B] of this one buffer: a per-graph output
        # would stay allocated for each of the (sizes x buckets) graphs (8.5 GB of float32 logits
        # per bucket for the 67 sizes up to 512 with a 128k vocabulary)
        self.logits: torch.Tensor | None = None

    def _metadata(self, b: int, max_len: int) -> AttentionMetadata:
        empty = self.seq_lens[:0]
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            slot_mapping=self.slots[:b], block_size=self.block_size,
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.seq_lens.device),
            prefill_seq_lens=empty, prefill_context_lens=empty,
            prefill_block_tables=self.block_tables[:0], max_prefill_query_len=0,
            max_prefill_seq_len=0, decode_seq_lens=self.seq_lens[:b],
            decode_block_tables=self.block_tables[:b], max_decode_seq_len=max_len,
            extras={"graph_max_seq_len": max_len})

    def _forward(self, b: int, max_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches,
                            self._metadata(b, max_len))
        return self.model.compute_logits(hidden, out)

    def _forward_into_logits(self, b: int, max_len: int) -> None:
        assert self.logits is not None
        self._forward(b, max_len, self.logits[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self.logits = torch.empty_like(self._forward(self.sizes[-1], self.context_lens[0]))
        # largest first, so smaller graphs reuse its pool
        for key in sorted(((b, n) for b in self.sizes for n in self.context_lens), reverse=True):
            self.graphs[key] = capture_graph(lambda: self._forward_into_logits(*key), pool,
                                             stream)
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s x contexts up to %s", self.sizes,
                    self.context_lens)

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (0 < len(batch.seqs) <= self.sizes[-1]
                and max(s.seq_len for s in batch.seqs) <= self.context_lens[-1]
                and all(s.num_tokens == 1 and s.num_samples >= 1 and not s.prompt_logprob_targets
                        for s in batch.seqs))

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Logits [B, vocab] for a decode-only input prepared by the model runner: a view of the
        shared buffer, valid for work queued before the next replay (stream order)."""
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
        max_len = self.context_lens[bisect.bisect_left(self.context_lens, meta.max_decode_seq_len)]
        self.graphs[size, max_len].replay()
        assert self.logits is not None
        return self.logits[:b]
