"""The attention layer a model uses: holds its backend's AttentionImpl and nothing else."""
from __future__ import annotations

from collections.abc import Callable

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

    def forward_rotary(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                       rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of a qkv projection whose q and k get ``rotary`` first (AttentionImpl)."""
        return self.impl.forward_rotary(qkv, *cos_sin, rotary, kv_cache, metadata)
