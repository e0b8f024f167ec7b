"""The cpu backend's ``fused_moe``: the reference's routing and grouping (moe_ops.run_grouped)
with each expert's two GEMMs on weights pre-packed once after loading, through the cpu linear op
(ops.py: oneDNN's packed native bf16/fp16 or float32 route, MKL's packed sgemm for float32).

F.linear on an unpacked expert slice lays the weight out again on every call: on the 2-core
Zen 4 box an 8-row GEMM of a [2048, 512] bf16 expert took ~0.8 ms (aten::mm), 74% of a Mixtral
decode step's time, against ~0.1-0.2 ms for a packed one of that size. The packs cost one more
copy of the expert weights (two for bf16/fp16 on the float32 route); they hang on the w13 / w2
parameters (``PACKED``), which the op receives.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backends.cpu import ops as cpu_ops
from pagedllm.models.layers.moe_ops import check_shapes, fused_moe_grouped, run_grouped

PACKED = "cpu_packed_experts"  # attribute of the w13 / w2 parameters: one packed linear per expert


def _pack(weight: torch.Tensor) -> SimpleNamespace:
    """One expert's [out, in] weight as the cpu linear op's prepared layer."""
    layer = SimpleNamespace(weight=weight.contiguous(), bias=None)
    cpu_ops.linear_prepare(layer)
    return layer


def fused_moe_prepare(experts: nn.Module) -> None:
    """Pack every expert of ``experts`` (moe.FusedExperts: w13 [E, 2I, H], w2 [E, H, I])."""
    for part in (experts.w13.weight, experts.w2.weight):
        setattr(part, PACKED, [_pack(part.data[e]) for e in range(part.shape[0])])


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """``fused_moe`` on packed experts; unpacked weights (no prepare) or an input of another
    dtype take ``fused_moe_grouped``."""
    up, down = getattr(w13, PACKED, None), getattr(w2, PACKED, None)
    if up is None or down is None or hidden.dtype != w13.dtype:
        return fused_moe_grouped(hidden, w13, w2, gating_output, topk, renormalize)
    check_shapes(hidden, w13, w2, gating_output, topk)
    inter = w2.shape[-1]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        h = cpu_ops.linear(x, up[e])  # [n, 2I]: gate, then up
        return cpu_ops.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e])

    return run_grouped(hidden, gating_output, topk, renormalize, w13.shape[0], expert)
