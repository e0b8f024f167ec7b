"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE on every
``decoder_sparse_step``-th layer except ``mlp_only_layers`` (those keep a dense MLP); routing
weights renormalized over the chosen experts only with ``norm_topk_prob``."""
from __future__ import annotations

import types
from typing import Any

from torch import nn

from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.moe import SparseMoeBlock, expert_stacked
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule for which layers are MoE."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: Any, ctx: LayerContext, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config.num_experts, config.num_experts_per_tok,
                                  config.hidden_size, config.moe_intermediate_size,
                                  bool(config.norm_topk_prob), ctx)
        dense = types.SimpleNamespace(hidden_size=config.hidden_size, hidden_act=config.hidden_act,
                                      intermediate_size=config.intermediate_size)
        return LlamaMLP(dense, ctx)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__(config, ctx, max_positions)
        # expert entries first: "experts.{e}.gate_proj" must not match the dense gate_proj entry
        self.stacked = (expert_stacked(config.num_experts, ("gate_proj", "up_proj", "down_proj"))
                        + LlamaForCausalLM.stacked)
