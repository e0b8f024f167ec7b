"""LayerNorm with weight and bias (GPT-2, GPT-NeoX), replicated on every tensor-parallel rank."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import LayerContext


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=ctx.dtype, device=ctx.device),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)
