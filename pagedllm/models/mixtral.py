"""Mixtral: the Llama block whose MLP is a sparse MoE (top-2 of 8 experts in the released models,
routing weights renormalized over the chosen experts)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.moe import SparseMoeBlock, expert_stacked
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ctx: LayerContext, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.num_local_experts, config.num_experts_per_tok,
                              config.hidden_size, config.intermediate_size, True, ctx)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

    def __init__(self, config: Any, ctx: LayerContext, max_positions: int) -> None:
        super().__init__(config, ctx, max_positions)
        # expert entries first: they are matched before the Llama fragments
        self.stacked = (expert_stacked(config.num_local_experts, ("w1", "w3", "w2"))
                        + LlamaForCausalLM.stacked)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                                    for name, tensor in weights)
