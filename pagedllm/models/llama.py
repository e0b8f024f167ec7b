"""Llama family over the paged cache: Llama 2/3, Mistral and Qwen2 (with their sliding windows),
TinyLlama."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.attention import Attention, layer_sliding_window
from pagedllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.linear import (LayerContext, MergedColumnParallelLinear,
                                           QKVParallelLinear, RowParallelLinear)
from pagedllm.models.layers.pipeline import (PPMissingLayer, empty_intermediate, is_pp_missing,
                                             make_layers)
from pagedllm.models.layers.rotary import RotaryEmbedding
from pagedllm.models.loader_utils import load_named_weights


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ctx.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 biases: tuple[bool, bool], sliding_window: int | None = None) -> None:
        super().__init__()
        qkv_bias, o_bias = biases
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, config.num_attention_heads,
                                          num_kv, qkv_bias, ctx)
        self.o_proj = RowParallelLinear(self.qkv_proj.num_heads * head_size * ctx.tp.size,
                                        config.hidden_size, o_bias, ctx)
        self.ctx = ctx
        self.rotary = rotary
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads,
                              head_size ** -0.5, ctx, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_size]
        out = self.attn.forward_rotary(qkv, cos_sin, self.ctx.ops.rotary, kv_cache, metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        self.check_activation(config)
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, ctx)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, ctx)
        self.ctx = ctx

    # the ops-registry op (looked up per call, as the backend may replace it) applying the activation to the gate half times the up half
    act_op = "silu_and_mul"

    @staticmethod
    def check_activation(config: Any) -> None:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; only 'silu'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(getattr(self.ctx.ops, self.act_op)(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # subclasses (qwen3.py, mixtral.py) swap the attention class and the MLP per layer
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 biases: tuple[bool, bool], sliding_window: int | None = None,
                 layer_idx: int = 0) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ctx)
        self.self_attn = self.attention_cls(config, ctx, rotary, biases, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ctx)
        self.mlp = self.make_mlp(config, ctx, layer_idx)

    def make_mlp(self, config: Any, ctx: LayerContext, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, ctx)

    def forward(self, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(hidden, residual)
        h = self.self_attn(positions, cos_sin, h, kv_cache, metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """HF-compatible weights; ``forward`` returns final hidden states [num_tokens, hidden]."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    # (our param suffix, HF name fragment, shard id)
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        biases = self.attention_biases(config)
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        pp = self.pp = ctx.pp
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # the first stage embeds; the last runs the final norm and the LM head (tied: the embedding)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if pp.is_first or (pp.is_last and self.tie_word_embeddings)
                             else PPMissingLayer())
        self.rotary = RotaryEmbedding(config, head_size, max_positions, ctx.dtype, ctx.device)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: self.layer_cls(config, ctx, self.rotary, biases,
                                     layer_sliding_window(config, i, max_positions), layer_idx=i),
            pp.rank, pp.size, ctx.layer_partition)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx) if pp.is_last else None
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, ctx) if pp.is_last
                        else PPMissingLayer())
        if self.tie_word_embeddings and pp.is_last:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                intermediate: dict[str, torch.Tensor] | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Final hidden states [num_tokens, hidden] on the last stage; on the others
        {"hidden_states", "residual"} for the next. ``kv_caches`` holds this stage's layers
        only; ``intermediate`` is the previous stage's output (None on the first)."""
        cos_sin = self.rotary(positions, metadata)
        if self.pp.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate is not None
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            hidden, residual = layer(positions, cos_sin, hidden, residual, kv_cache, metadata)
        if not self.pp.is_last:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype,
                                        device: torch.device) -> dict[str, torch.Tensor]:
        return empty_intermediate(("hidden_states", "residual"), num_tokens,
                                  self.config.hidden_size, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            name = name.replace("self_attn.o_proj.bias", "self_attn.o_proj.out_bias") \
                       .replace("mlp.down_proj.bias", "mlp.down_proj.out_bias")
            return None if is_pp_missing(self, name) else name  # another stage's tensor

        return load_named_weights(self, weights, rename, self.stacked)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on the q/k/v projections (and usually tied embeddings); with
    ``use_sliding_window`` the layers from ``max_window_layers`` on run the sliding window
    (``config.layer_types``)."""

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer (``config.sliding_window``, None: off)."""
