"""GPT-NeoX (Pythia, StableLM-alpha) over the paged cache: LayerNorm blocks with a parallel
residual (x + attn(ln1(x)) + mlp(ln2(x))) or the sequential one, partial rotary (``rotary_pct``),
q/k/v interleaved per head in ``query_key_value``, an untied ``embed_out`` head by default."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.activation import get_act_fn
from pagedllm.models.layers.attention import Attention
from pagedllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.layernorm import LayerNorm
from pagedllm.models.layers.linear import (ColumnParallelLinear, LayerContext, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.rotary import RotaryEmbedding, rotate_qkv
from pagedllm.models.loader_utils import load_named_weights


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_size = h // heads
        bias = bool(getattr(config, "attention_bias", True))
        self.query_key_value = QKVParallelLinear(h, self.head_size, heads, heads, bias, ctx)
        self.dense = RowParallelLinear(h, h, bias, ctx)
        self.ctx = ctx
        self.rotary = rotary
        self.attn = Attention(self.query_key_value.num_heads, self.head_size,
                              self.query_key_value.num_heads, self.head_size ** -0.5, ctx)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        heads = self.query_key_value.num_heads
        q, k, v = rotate_qkv(self.query_key_value(hidden), *cos_sin, self.ctx.ops.rotary, heads,
                             heads, self.head_size)
        return self.dense(self.attn(q, k, v, kv_cache, metadata))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                                  True, ctx)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                               True, ctx)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, ctx)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, ctx)
        self.attention = GPTNeoXAttention(config, ctx, rotary)
        self.mlp = GPTNeoXMLP(config, ctx)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        attn = self.attention(cos_sin, self.input_layernorm(hidden), kv_cache, metadata)
        if self.use_parallel_residual:  # transformers' order of the three-way sum
            return self.mlp(self.post_attention_layernorm(hidden)) + attn + hidden
        attn = attn + hidden
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class GPTNeoXForCausalLM(nn.Module):
    stacked = [("query_key_value", "q_part", "q"), ("query_key_value", "k_part", "k"),
               ("query_key_value", "v_part", "v")]

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_in = VocabParallelEmbedding(config.vocab_size, h, ctx)
        self.rotary = RotaryEmbedding(config, h // config.num_attention_heads, max_positions,
                                      ctx.dtype, ctx.device)
        self.layers = nn.ModuleList([GPTNeoXLayer(config, ctx, self.rotary)
                                     for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = LayerNorm(h, config.layer_norm_eps, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_out = ParallelLMHead(config.vocab_size, h, ctx)
        if self.tie_word_embeddings:
            self.embed_out.weight = self.embed_in.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_in(input_ids)
        cos_sin = self.rotary(positions, metadata)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(cos_sin, hidden, kv_cache, metadata)
        return self.final_layer_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_out.compute_logits(hidden, out)

    def _deinterleaved(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """query_key_value rows are [head][q|k|v][head_size]; yield q, k and v parts."""
        heads = self.config.num_attention_heads
        for name, tensor in weights:
            if ".query_key_value." not in name:
                yield name, tensor
                continue
            parts = tensor.reshape(heads, 3, -1, *tensor.shape[1:])  # [heads, 3, d, (hidden)]
            for i, part in enumerate(("q_part", "k_part", "v_part")):
                yield (name.replace(".query_key_value.", f".{part}."),
                       parts[:, i].reshape(-1, *tensor.shape[1:]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name.startswith("gpt_neox."):
                name = name[len("gpt_neox."):]
            if name.endswith((".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")):
                return None  # old checkpoints' mask and rotary buffers
            if name.startswith("embed_out.") and self.tie_word_embeddings:
                return None
            return (name.replace(".attention.dense.bias", ".attention.dense.out_bias")
                    .replace(".mlp.dense_4h_to_h.bias", ".mlp.dense_4h_to_h.out_bias"))

        return load_named_weights(self, self._deinterleaved(weights), rename, self.stacked)
