"""Qwen3: the Llama block with an RMSNorm over each query and key head before the rotary
(``q_norm`` / ``k_norm``, one [head_dim] weight shared by all heads)."""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, ctx: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, ctx, *args, **kwargs)
        self.head_size = self.qkv_proj.head_size
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, ctx)

    def forward(self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_size]
        t, d = qkv.shape[0], self.head_size
        q, k, v = qkv.split([self.qkv_proj.num_heads * d, self.qkv_proj.num_kv_heads * d,
                             self.qkv_proj.num_kv_heads * d], dim=-1)
        q, _ = self.q_norm(q.reshape(t, -1, d))  # normalized per head: [T, heads, head_size]
        k, _ = self.k_norm(k.reshape(t, -1, d))
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v], dim=-1)
        out = self.attn.forward_rotary(qkv, cos_sin, self.ctx.ops.rotary, kv_cache, metadata)
        return self.o_proj(out)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense; q/k/v and o_proj biases follow ``attention_bias`` (off in released models)."""

    layer_cls = Qwen3DecoderLayer
