"""The attention layer a model uses: holds its backend's AttentionImpl and nothing else."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.linear import LayerContext


def layer_sliding_window(config: Any, layer_idx: int, max_positions: int | None = None) -> int | None:
    """The window of layer ``layer_idx`` as transformers applies it (None: full attention).

    With ``config.layer_types`` (Qwen2, Gemma 2/3): ``config.sliding_window`` on the
    "sliding_attention" layers only; without it (Mistral): on every layer unless
    ``use_sliding_window`` is False. A window covering ``max_positions`` changes nothing and
    is dropped (the layer then runs plain attention).
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    if max_positions is not None and window >= max_positions:
        return None
    return int(window)


def model_sliding_window(config: Any, max_positions: int) -> int | None:
    """The window when every layer of the model has one (the largest), else None: only then can
    KV blocks behind it be freed (core/block_manager.py). Read as ``layer_sliding_window``."""
    windows = [layer_sliding_window(config, i, max_positions)
               for i in range(getattr(config, "num_hidden_layers", 0) or 0)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 ctx: LayerContext, *, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        # the optional features are passed only when set (plugin API 1.x impls take none)
        extra: dict[str, Any] = {}
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            extra["logits_soft_cap"] = logits_soft_cap
        self.impl = ctx.attn_cls(num_heads, head_size, num_kv_heads, scale, **extra)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.impl.forward(q, k, v, kv_cache, metadata)

    def forward_rotary(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                       rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of a qkv projection whose q and k get ``rotary`` first (AttentionImpl)."""
        return self.impl.forward_rotary(qkv, *cos_sin, rotary, kv_cache, metadata)
