"""Phi-3 / 3.5 / 4-mini: the Llama block with q/k/v and gate/up stored fused in the checkpoint
(``qkv_proj``, ``gate_up_proj``), LongRoPE (su) scaling with short and long factors, partial
rotary (``partial_rotary_factor``, Phi-4-mini) and an optional sliding window on every layer."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.rotary import rotate_qkv
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.loader_utils import split_fused


class PartialRotaryAttention(LlamaAttention):
    """LlamaAttention whose rotary may cover only the first ``rotary.rotary_dim`` channels."""

    def forward(self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        proj = self.qkv_proj
        if self.rotary.rotary_dim == proj.head_size:
            return super().forward(positions, cos_sin, hidden, kv_cache, metadata)
        q, k, v = rotate_qkv(proj(hidden), *cos_sin, self.ctx.ops.rotary, proj.num_heads,
                             proj.num_kv_heads, proj.head_size)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = PartialRotaryAttention


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = Phi3DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        c = self.config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        fused: dict[str, list[tuple[str, int]]] = {
            "qkv_proj": [("q_proj", c.num_attention_heads * d), ("k_proj", kv * d),
                         ("v_proj", kv * d)],
            "gate_up_proj": [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)],
        }
        return super().load_weights(split_fused(weights, fused))

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return False, False
