"""GPT-2 over the paged cache: learned positions, pre-LayerNorm blocks, Conv1D weights (stored
[in, out], transposed at load), fused c_attn q/k/v, GELU (``gelu_new``), LM head tied to wte."""
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
from pagedllm.models.loader_utils import load_named_weights, split_fused

CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # [in, out] in the checkpoint


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, layer_idx: int) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        d = h // heads
        self.c_attn = QKVParallelLinear(h, d, heads, heads, True, ctx)
        self.c_proj = RowParallelLinear(h, h, True, ctx)
        scale = d ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        if getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError("reorder_and_upcast_attn=True is not supported for GPT-2")
        self.attn = Attention(self.c_attn.num_heads, d, self.c_attn.num_heads, scale, ctx)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # this rank's heads, [T, local h] each
        return self.c_proj(self.attn(q, k, v, kv_cache, metadata))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        h = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * h
        self.c_fc = ColumnParallelLinear(h, inner, True, ctx)
        self.c_proj = RowParallelLinear(inner, h, True, ctx)
        self.act = get_act_fn(config.activation_function, "activation_function")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps, ctx)
        self.attn = GPT2Attention(config, ctx, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps, ctx)
        self.mlp = GPT2MLP(config, ctx)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(nn.Module):
    stacked = [("c_attn", "q_proj", "q"), ("c_attn", "k_proj", "k"), ("c_attn", "v_proj", "v")]

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        if getattr(config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True (an encoder-decoder GPT-2) is not supported")
        h = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, h, ctx)
        self.wpe = nn.Parameter(torch.empty(config.n_positions, h, dtype=ctx.dtype,
                                            device=ctx.device), requires_grad=False)
        self.h = nn.ModuleList([GPT2Block(config, ctx, i) for i in range(config.num_hidden_layers)])
        self.ln_f = LayerNorm(h, config.layer_norm_epsilon, ctx)
        self.lm_head = ParallelLMHead(config.vocab_size, h, ctx)
        self.lm_head.weight = self.wte.weight  # GPT-2 always ties the LM head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe[positions]
        for block, kv_cache in zip(self.h, kv_caches):
            hidden = block(hidden, kv_cache, metadata)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)

    def _converted(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith("transformer."):
                name = name[len("transformer."):]
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name.startswith("lm_head."):
                continue  # causal-mask buffers of old checkpoints; the tied head
            if name.endswith(CONV1D):
                tensor = tensor.t()  # Conv1D [in, out] -> [out, in]
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        h = self.config.hidden_size
        fused = {"c_attn": [("q_proj", h), ("k_proj", h), ("v_proj", h)]}

        def rename(name: str) -> str | None:
            name = name.replace(".c_proj.bias", ".c_proj.out_bias")
            return "wpe" if name == "wpe.weight" else name

        return load_named_weights(self, split_fused(self._converted(weights), fused), rename,
                                  self.stacked)
