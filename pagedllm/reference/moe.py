"""The ``fused_moe`` op (vLLM's signature): top-k routing and the SiLU-gated experts of a sparse
MoE block in one call. ``fused_moe`` is the per-expert torch reference (the ops-registry default,
what the conformance suite compares to); ``fused_moe_grouped``: the (token, slot) pairs sorted
by expert once, then one matmul pair per expert hit, bit-equal to the reference (``run_grouped``
takes the expert MLP as a function: the cpu backend's runs on pre-packed weights,
backends/cpu/fused_moe.py); ``fused_moe_prepare`` runs once per block after loading. Torch only.

Shapes: hidden [T, H]; w13 [E, 2 * I, H] (gate rows then up rows, HF's w1 then w3); w2 [E, H, I];
gating_output [T, E] router logits. Returns [T, H] in hidden's dtype.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def select_experts(gating_output: torch.Tensor, topk: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, topk] float32, expert ids [T, topk] int64): softmax over the experts in
    float32, the top ``topk``, renormalized to sum to 1 when asked (Mixtral always; Qwen3-MoE
    with ``norm_topk_prob``), as transformers' routers compute them."""
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its rows x [n, H]: (silu(x w1^T) * x w3^T) w2^T, in x's dtype."""
    inter = w2.shape[-1]
    h = F.linear(x, w13)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    return F.linear(h, w2)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            weight: torch.Tensor) -> torch.Tensor:
    """``expert_mlp`` scaled per row by the float32 routing ``weight`` [n] (a float32 result)."""
    return expert_mlp(x, w13, w2) * weight[:, None]


def fused_moe_prepare(experts: torch.nn.Module) -> None:
    """Called once per MoE block's experts (``w13``, ``w2`` submodules) after loading, e.g. to
    pre-pack each expert's weights; the reference needs nothing."""


def check_shapes(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           gating_output: torch.Tensor, topk: int) -> None:
    e, two_i, h = w13.shape
    if (w2.shape != (e, h, two_i // 2) or hidden.shape[-1] != h
            or gating_output.shape != (hidden.shape[0], e) or not 1 <= topk <= e):
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 "
                         f"{tuple(w2.shape)}, gating_output {tuple(gating_output.shape)}, "
                         f"topk={topk} do not fit [T, H], [E, 2I, H], [E, H, I], [T, E], 1..E")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """Reference: for each expert in order, the rows routed to it (slot-major, like
    transformers' expert loop), their output times the routing weight added into the result."""
    check_shapes(hidden, w13, w2, gating_output, topk)
    weights, ids = select_experts(gating_output, topk, renormalize)
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        slot, tok = torch.where(ids.t() == e)  # [topk, T] mask: slot-major order
        if tok.numel() == 0:
            continue
        y = _expert(hidden[tok], w13[e], w2[e], weights[tok, slot])
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def group_by_expert(ids: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, slot) pairs sorted by expert, slot-major within an expert (the reference's
    order): (token [T * topk], slot [T * topk], pairs per expert [E])."""
    t = ids.shape[0]
    flat = ids.t().reshape(-1)  # pair p = slot * T + token
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order % t, order // t, counts


def run_grouped(hidden: torch.Tensor, gating_output: torch.Tensor, topk: int,
                renormalize: bool, num_experts: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed pairs grouped by expert (one sort, one gather), ``expert(e, rows [n, H])``
    -> its MLP output [n, H] in hidden's dtype, run once per expert hit, then scaled by the
    routing weights and summed per token exactly as the reference does."""
    weights, ids = select_experts(gating_output, topk, renormalize)
    tok, slot, counts = group_by_expert(ids, num_experts)
    x = hidden[tok]  # [T * topk, H], grouped by expert
    pair_weights = weights[tok, slot]
    out = torch.zeros_like(hidden)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        y = expert(e, x[rows]) * pair_weights[rows, None]
        out.index_add_(0, tok[rows], y.to(out.dtype))
        start += n
    return out


def fused_moe_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """One sort and one gather instead of a mask scan per expert; the experts that no token
    picked cost nothing. Same rows, order and arithmetic as ``fused_moe``."""
    check_shapes(hidden, w13, w2, gating_output, topk)
    return run_grouped(hidden, gating_output, topk, renormalize, w13.shape[0],
                       lambda e, x: expert_mlp(x, w13[e], w2[e]))


def fused_moe_dense(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """The static-shape path (tpu/XLA: no data-dependent shapes, one compiled graph per bucket):
    every expert runs on every token and is weighted by its routing weight, zero for the experts
    a token did not pick. E / topk times the reference's expert FLOPs; same expert order."""
    check_shapes(hidden, w13, w2, gating_output, topk)
    weights, ids = select_experts(gating_output, topk, renormalize)
    # [T, E] routing weight of each expert for each token (0 where not chosen)
    dense = torch.zeros(gating_output.shape, dtype=weights.dtype,
                        device=weights.device).scatter(1, ids, weights)
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        out = out + _expert(hidden, w13[e], w2[e], dense[:, e]).to(out.dtype)
    return out
