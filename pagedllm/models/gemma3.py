"""Gemma 3 (text) over the paged cache: Gemma 2's blocks plus per-head q/k (1 + w) RMSNorms and
separate rotary tables for the sliding (local base) and global layers
(``config.rope_parameters[layer_type]``; transformers 4's ``rope_local_base_freq`` too)."""
from __future__ import annotations

import copy
from typing import Any

import torch

from pagedllm.models.gemma2 import (Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM,
                                    GemmaRMSNorm, head_size_of)
from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.rotary import RotaryEmbedding


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__(config, ctx, rotary, sliding_window)
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, ctx)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, ctx)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each q and k head normalized over head_size before the rotary; v untouched."""
        t, d = qkv.shape[0], self.head_size
        q_size = self.qkv_proj.num_heads * d
        k_size = self.qkv_proj.num_kv_heads * d
        q, k, v = qkv.split([q_size, k_size, k_size], dim=-1)
        q, _ = self.q_norm(q.reshape(-1, d))  # [T * num_heads, D]
        k, _ = self.k_norm(k.reshape(-1, d))  # [T * num_kv_heads, D]
        return torch.cat([q.reshape(t, q_size), k.reshape(t, k_size), v], dim=-1)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


def rope_config(config: Any, layer_type: str) -> Any:
    """A shallow copy of ``config`` carrying only the rope settings of ``layer_type``, in the
    form RotaryEmbedding reads. transformers 5: ``rope_parameters[layer_type]``; transformers 4:
    ``rope_theta`` / ``rope_scaling`` on global layers, ``rope_local_base_freq`` (no scaling) on
    sliding ones."""
    view = copy.copy(config)
    local_base = getattr(config, "rope_local_base_freq", None)
    params = getattr(config, "rope_parameters", None)
    if local_base:
        view.rope_parameters = None
        if layer_type == "sliding_attention":
            view.rope_theta, view.rope_scaling = local_base, None
    elif isinstance(params, dict) and layer_type in params:
        view.rope_parameters = dict(params[layer_type])
    return view


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return list(self.rotaries.values()) if hasattr(self, "rotaries") else []

    def rotary_for(self, config: Any, layer_idx: int, max_positions: int) -> RotaryEmbedding:
        """The table of the layer's type, built once per type."""
        if not hasattr(self, "rotaries"):
            self.rotaries = torch.nn.ModuleDict()
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * (layer_idx + 1)
        kind = layer_types[layer_idx]
        if kind not in self.rotaries:
            self.rotaries[kind] = RotaryEmbedding(rope_config(config, kind), head_size_of(config),
                                                  max_positions, self.ctx.dtype, self.ctx.device)
        return self.rotaries[kind]
