"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a replicated router and the experts'
SiLU-gated MLPs stacked in two 3-D weights, run by the ``fused_moe`` op (moe_ops.py).

Tensor parallel: every rank holds all experts, each sharded on the intermediate dim (w13 rows,
w2 columns), and the block's output is all-reduced, as in vLLM's FusedMoE.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.linear import LayerContext, ReplicatedLinear


class ExpertWeights(nn.Module):
    """``weight`` [E, rows, cols]: w13 [E, 2 * I_local, H] (``part`` 0 = gate/w1, 1 = up/w3) or
    w2 [E, H, I_local]. Loads one expert's HF tensor at a time: shard_id = (expert, part)."""

    def __init__(self, num_experts: int, rows: int, cols: int, ctx: LayerContext,
                 is_down: bool) -> None:
        super().__init__()
        self.ctx = ctx
        self.is_down = is_down
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=ctx.dtype,
                                               device=ctx.device), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        expert, part = shard_id  # type: ignore[misc]
        rank = self.ctx.tp.rank
        if self.is_down:  # HF [H, I]: this rank's columns
            n = param.shape[2]
            src, dst = loaded.narrow(1, rank * n, n), param[expert]
        else:  # HF [I, H]: this rank's rows, into the gate or the up half
            n = param.shape[1] // 2
            src, dst = loaded.narrow(0, rank * n, n), param[expert].narrow(0, part * n, n)
        if src.shape != dst.shape:
            raise ValueError(f"expert {expert}: checkpoint tensor of shape {tuple(loaded.shape)} "
                             f"does not fit expert weight of shape {tuple(param.shape[1:])}")
        dst.copy_(src)


def expert_stacked(num_experts: int, names: tuple[str, str, str]) -> list[tuple[str, str, object]]:
    """Entries for ``load_named_weights``' stacked list: each HF per-expert tensor
    ``experts.{e}.{gate|up|down}`` routed to the stacked w13 / w2 with shard id (e, part).
    ``names``: the checkpoint's (gate, up, down) names, ("w1", "w3", "w2") for Mixtral."""
    gate, up, down = names
    out: list[tuple[str, str, object]] = []
    for e in range(num_experts):
        out += [("experts.w13", f"experts.{e}.{gate}", (e, 0)),
                ("experts.w13", f"experts.{e}.{up}", (e, 1)),
                ("experts.w2", f"experts.{e}.{down}", (e, 0))]
    return out


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 ctx: LayerContext) -> None:
        super().__init__()
        inter = ctx.tp.shard(intermediate_size, "expert intermediate size")
        self.w13 = ExpertWeights(num_experts, 2 * inter, hidden_size, ctx, is_down=False)
        self.w2 = ExpertWeights(num_experts, hidden_size, inter, ctx, is_down=True)


class SparseMoeBlock(nn.Module):
    """x [T, H] -> [T, H]: router logits, top-k experts per token, their weighted sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, ctx: LayerContext) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}] "
                             f"(the number of experts)")
        self.ctx = ctx
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, ctx)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        out = self.ctx.ops.fused_moe(x, self.experts.w13.weight, self.experts.w2.weight,
                                     router_logits, self.top_k, self.renormalize)
        return self.ctx.tp.all_reduce(out) if self.ctx.tp.size > 1 else out
