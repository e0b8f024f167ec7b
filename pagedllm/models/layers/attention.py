"""The attention layer a model uses: holds its backend's AttentionImpl and nothing else."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.models.layers.linear import LayerContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 ctx: LayerContext) -> None:
        super().__init__()
        self.impl = ctx.attn_cls(num_heads, head_size, num_kv_heads, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.impl.forward(q, k, v, kv_cache, metadata)
