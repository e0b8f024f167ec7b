"""Gemma 2 over the paged cache: logit soft-capping in attention and at the head, sliding-window
layers alternating with global ones (``config.layer_types``), ``query_pre_attn_scalar``,
GELU-tanh, embeddings scaled by sqrt(hidden), the (1 + w) RMSNorm and pre/post feed-forward
norms. Gemma 3 (text) builds on these blocks (gemma3.py)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.models.layers.attention import Attention, layer_sliding_window
from pagedllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.linear import LayerContext, QKVParallelLinear, RowParallelLinear
from pagedllm.models.layers.pipeline import (PPMissingLayer, empty_intermediate, is_pp_missing,
                                             make_layers)
from pagedllm.models.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.loader_utils import load_named_weights

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma norm: (x * rsqrt(mean(x^2) + eps)) * (1 + w), in float32, then cast:
    the ``gemma_rms_norm`` op (ops.py; one fused pass on the cpu kernels).

    The checkpoint stores w (zeros = identity); 1 + w is formed in float32 inside the op, as
    transformers does, so half-precision models round once, at the end."""

    def __init__(self, size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); with ``residual``, normalizes ``x + residual``."""
        return self.ctx.ops.gemma_rms_norm(x, self.weight, self.eps, residual)


def head_size_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Gemma2Attention(nn.Module):
    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        head_size = head_size_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, config.num_attention_heads,
                                          config.num_key_value_heads, bias, ctx)
        self.o_proj = RowParallelLinear(self.qkv_proj.num_heads * head_size * ctx.tp.size,
                                        config.hidden_size, bias, ctx)
        self.ctx = ctx
        self.rotary = rotary
        self.head_size = head_size
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads,
                              config.query_pre_attn_scalar ** -0.5, ctx,
                              sliding_window=sliding_window,
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Gemma 3's per-head q/k norms (gemma3.py); Gemma 2 has none."""
        return qkv

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``cos_sin``: this layer's rotary table rows for the step's positions, [T, D] each."""
        qkv = self.qk_norm(self.qkv_proj(hidden))  # [T, (num_heads + 2 * num_kv_heads) * D]
        out = self.attn.forward_rotary(qkv, cos_sin, self.ctx.ops.rotary, kv_cache, metadata)
        return self.o_proj(out)


class Gemma2MLP(LlamaMLP):
    """Llama's gated MLP with GELU-tanh (no biases: Gemma configs have no mlp_bias)."""

    act_op = "gelu_tanh_and_mul"

    @staticmethod
    def check_activation(config: Any) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in GELU_TANH:
            raise ValueError(f"hidden_activation={act!r} is not supported; supported: "
                             f"{', '.join(GELU_TANH)}")


class Gemma2DecoderLayer(nn.Module):
    """h' = h + post_ff_norm(mlp(pre_ff_norm(h + post_attn_norm(attn(input_norm(h)))))); the
    residual adds are folded into the next norm (its ``residual`` argument)."""

    attention_cls = Gemma2Attention

    def __init__(self, config: Any, ctx: LayerContext, rotary: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.self_attn = self.attention_cls(config, ctx, rotary, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx)
        self.mlp = Gemma2MLP(config, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ctx)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's last branch output, the residual it is to be added to)."""
        h, residual = self.input_layernorm(hidden, residual)
        h = self.self_attn(cos_sin, h, kv_cache, metadata)
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class Gemma2ForCausalLM(nn.Module):
    """HF-compatible weights; ``forward`` returns final hidden states [num_tokens, hidden] (on a
    pipeline stage other than the last: {"hidden_states", "residual"} for the next one)."""

    layer_cls = Gemma2DecoderLayer
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        pp = self.pp = ctx.pp
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        # the first stage embeds; the last runs the final norm and the LM head (tied: the embedding)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
                             if pp.is_first or (pp.is_last and self.tie_word_embeddings)
                             else PPMissingLayer())
        # transformers multiplies by sqrt(hidden) rounded to the model dtype
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5, dtype=ctx.dtype,
                                                        device=ctx.device), persistent=False)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: self.layer_cls(config, ctx, self.rotary_for(config, i, max_positions),
                                     layer_sliding_window(config, i, max_positions)),
            pp.rank, pp.size, ctx.layer_partition)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ctx) if pp.is_last else None
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, ctx) if pp.is_last
                        else PPMissingLayer())
        if self.tie_word_embeddings and pp.is_last:
            self.lm_head.weight = self.embed_tokens.weight
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    def rotary_for(self, config: Any, layer_idx: int, max_positions: int) -> RotaryEmbedding:
        """One table shared by every layer (Gemma 3 keeps one per layer type)."""
        if not hasattr(self, "rotary"):
            self.rotary = RotaryEmbedding(config, head_size_of(config), max_positions,
                                          self.ctx.dtype, self.ctx.device)
        return self.rotary

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """The distinct rotary tables of this stage's layers."""
        return [self.rotary] if hasattr(self, "rotary") else []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                intermediate: dict[str, torch.Tensor] | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``kv_caches`` holds this stage's layers only; ``intermediate`` is the previous
        stage's output (None on the first)."""
        if self.pp.is_first:
            hidden, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            assert intermediate is not None
            hidden, residual = intermediate["hidden_states"], intermediate["residual"]
        # each rotary table's rows for this step, looked up once (Gemma 3: one table per type)
        cos_sin = {id(r): r(positions, metadata) for r in self.rotary_tables()}
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            table = cos_sin[id(layer.self_attn.rotary)]
            hidden, residual = layer(table, hidden, residual, kv_cache, metadata)
        if not self.pp.is_last:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype,
                                        device: torch.device) -> dict[str, torch.Tensor]:
        return empty_intermediate(("hidden_states", "residual"), num_tokens,
                                  self.config.hidden_size, dtype, device)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [tokens, vocab]; final soft cap: cap * tanh(logits / cap), in place."""
        logits = self.lm_head.compute_logits(hidden, out)
        if self.final_soft_cap is not None:
            logits.div_(self.final_soft_cap).tanh_().mul_(self.final_soft_cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            name = name.replace("self_attn.o_proj.bias", "self_attn.o_proj.out_bias")
            return None if is_pp_missing(self, name) else name  # another stage's tensor

        return load_named_weights(self, weights, rename, self.stacked)
