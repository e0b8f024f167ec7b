"""OPT over the paged cache (learned positions with offset 2, LayerNorm, ReLU MLP, tied LM head)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.attention import Attention
from pagedllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.linear import (ColumnParallelLinear, LayerContext, QKVParallelLinear,
                                           ReplicatedLinear, RowParallelLinear)
from pagedllm.models.layers.pipeline import (PPMissingLayer, empty_intermediate, is_pp_missing,
                                             make_layers)
from pagedllm.models.loader_utils import load_named_weights

_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class LayerNorm(nn.Module):
    def __init__(self, size: int, ctx: LayerContext) -> None:
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=ctx.dtype, device=ctx.device),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.size,), self.weight, self.bias, 1e-5)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        if config.activation_function != "relu":
            raise ValueError(f"activation_function={config.activation_function!r} is not "
                             "supported for OPT; only 'relu'")
        h, heads = config.hidden_size, config.num_attention_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.head_size = h // heads
        self.qkv_proj = QKVParallelLinear(h, self.head_size, heads, heads, bias, ctx)
        self.out_proj = RowParallelLinear(h, h, bias, ctx)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_size, self.qkv_proj.num_heads,
                              self.head_size ** -0.5, ctx)
        self.self_attn_layer_norm = LayerNorm(h, ctx)
        self.fc1 = ColumnParallelLinear(h, config.ffn_dim, bias, ctx)
        self.fc2 = RowParallelLinear(config.ffn_dim, h, bias, ctx)
        self.final_layer_norm = LayerNorm(h, ctx)
        self.pre_norm = bool(config.do_layer_norm_before)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        hidden = residual + self.out_proj(self.attn(q, k, v, kv_cache, metadata))
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(F.relu(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTForCausalLM(nn.Module):
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        embed_dim = config.word_embed_proj_dim
        pp = ctx.pp
        # the first stage embeds; the last runs the final norm and the (always tied) LM head
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, embed_dim, ctx)
                             if pp.is_first or pp.is_last else PPMissingLayer())
        self.embed_positions = nn.Parameter(
            torch.empty(config.max_position_embeddings + _POSITION_OFFSET, config.hidden_size,
                        dtype=ctx.dtype, device=ctx.device),
            requires_grad=False) if pp.is_first else None
        self.project_in = (ReplicatedLinear(embed_dim, config.hidden_size, False, ctx)
                           if embed_dim != config.hidden_size and pp.is_first else None)
        self.project_out = (ReplicatedLinear(config.hidden_size, embed_dim, False, ctx)
                            if embed_dim != config.hidden_size and pp.is_last else None)
        self.final_layer_norm = (LayerNorm(config.hidden_size, ctx)
                                 if config.do_layer_norm_before and pp.is_last
                                 and not getattr(config, "_remove_final_layer_norm", False) else None)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: OPTDecoderLayer(config, ctx), pp.rank, pp.size,
            ctx.layer_partition)
        self.pp = pp
        if pp.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, embed_dim, ctx)
            self.lm_head.weight = self.embed_tokens.weight  # OPT always ties the LM head
        else:
            self.lm_head = PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                intermediate: dict[str, torch.Tensor] | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Final hidden states [num_tokens, embed_dim] on the last stage; on the others
        {"hidden_states": [num_tokens, hidden]} for the next. ``kv_caches`` holds this stage's
        layers only; ``intermediate`` is the previous stage's output (None on the first)."""
        if self.pp.is_first:
            hidden = self.embed_tokens(input_ids)
            if self.project_in is not None:
                hidden = self.project_in(hidden)
            hidden = hidden + self.embed_positions[positions + _POSITION_OFFSET]
        else:
            assert intermediate is not None
            hidden = intermediate["hidden_states"]
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            hidden = layer(hidden, kv_cache, metadata)
        if not self.pp.is_last:
            return {"hidden_states": hidden}
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype,
                                        device: torch.device) -> dict[str, torch.Tensor]:
        return empty_intermediate(("hidden_states",), num_tokens, self.hidden_size, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            for prefix in ("model.decoder.", "decoder."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
            if name.startswith("lm_head."):
                return None
            name = name.replace("self_attn.out_proj.", "out_proj.").replace("self_attn.", "")
            name = name.replace("out_proj.bias", "out_proj.out_bias").replace("fc2.bias", "fc2.out_bias")
            name = "embed_positions" if name == "embed_positions.weight" else name
            return None if is_pp_missing(self, name) else name  # another stage's tensor

        return load_named_weights(self, weights, rename, self.stacked)
