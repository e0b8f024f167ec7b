"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import LayerContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        tp = ctx.tp
        self.per_rank = -(-vocab_size // tp.size)  # last rank's slice may be padded
        self.start = tp.rank * self.per_rank
        self.end = max(self.start, min(self.start + self.per_rank, vocab_size))  # may be empty
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=ctx.dtype,
                                               device=ctx.device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return self.ctx.tp.all_reduce(out)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, expected vocab_size="
                             f"{self.vocab_size}")
        param.data[: self.end - self.start].copy_(loaded[self.start:self.end])


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered so every rank holds the full [n, vocab]."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext) -> None:
        super().__init__(vocab_size, hidden_size, ctx)
        self.bias = None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [tokens, vocab]; written into ``out`` (converted in the same copy) when
        given, e.g. a CUDA graph's shared logits buffer."""
        logits = self.ctx.ops.linear(hidden, self)
        if self.ctx.tp.size > 1:
            logits = self.ctx.tp.all_gather(logits)
        logits = logits[..., : self.vocab_size]
        return logits.float() if out is None else out.copy_(logits)
