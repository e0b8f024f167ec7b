"""The cpu backend's ``fused_moe``: the reference's routing and grouping with each expert's two
GEMMs on weights pre-packed once after loading, through the cpu linear op (ops.py: oneDNN's packed
native bf16/fp16 or float32 route, MKL's packed sgemm for float32).

F.linear on an unpacked expert slice lays the weight out again on every call: on the 2-core
Zen 4 box an 8-row GEMM of a [2048, 512] bf16 expert took ~0.8 ms (aten::mm), 74% of a Mixtral
decode step's time, against ~0.1-0.2 ms for a packed one of that size. The packs hang on the
w13 / w2 parameters (``PACKED``), which the op receives.

One call per MoE layer: where the C++ kernels load (csrc/cpu/fused_moe_cpu.cpp), the whole layer
(routing, grouping, every expert's GEMMs on the same packs, the weighted sum) is
``torch.ops.pagedllm_cpu.fused_moe_packed``, bit-equal to ``moe_ops.run_grouped`` with
``cpu_ops.linear`` as the expert MLP, which stays the path where they do not load. The Python loop
cost ~8 torch ops per expert hit, more than the GEMMs at decode sizes: one mixtral-moe-100m layer
(H 512, I 1024, 8 experts, top-2) on one thread of the Zen 4 box took 6.2 -> 4.6 ms CPU at 64
tokens and 78.5 -> 71.9 ms at 2048 in bf16 (float32: 6.8 -> 6.1, 137 -> 132 ms).

The experts hit run concurrently on torch's threads, one single-threaded GEMM pair per thread,
on oneDNN's route (no thread barrier per GEMM; oneDNN's results do not depend on its thread
count); MKL's sgemm splits its reductions by thread count, so its route runs them one by one.
$PAGEDLLM_CPU_MOE_PARALLEL=0 runs oneDNN's experts one by one too (=1: in parallel, the default).

Memory: the packs are all that either path reads (MKL's packed sgemm takes the plain weight too,
but only checks its dtype and reads its shape when told the row count it was packed for: it gets a
stride-0 NaN of that shape), so the unpacked w13 / w2 storage is released at this op's first call
on the packs (not when packing: a test or user may swap the reference op in after the backend
registered its ops, and the reference reads the unpacked weights): the parameters keep shape,
dtype and device as a stride-0 NaN view and are marked ``RELEASED``;
$PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS=1 keeps them (debugging). Unpacked experts (no oneDNN: plain
F.linear) keep them too.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from pagedllm import envs
from pagedllm.backends.cpu import ops as cpu_ops
from pagedllm.backends.cpu.kernels import MOE, optional_cpu_kernels
from pagedllm.reference.moe import check_shapes, fused_moe_grouped, run_grouped

PACKED = "cpu_packed_experts"  # attribute of the w13 / w2 parameters: one packed linear per expert
OP_WEIGHTS = "cpu_fused_moe_weights"  # attribute of w13: the C++ op's weight arguments
RELEASED = "cpu_unpacked_released"  # attribute of w13 / w2: True once their storage was freed
RELEASE_PENDING = "cpu_unpacked_release_pending"  # attribute of w13: release at the next call
ROUTE_ONEDNN, ROUTE_MKL = 0, 1  # fused_moe_cpu.cpp's route argument
KEEP_UNPACKED_ENV = cpu_ops.KEEP_UNPACKED_ENV  # =1: keep the unpacked weights
PARALLEL_ENV = "PAGEDLLM_CPU_MOE_PARALLEL"  # =0: the experts one by one on multi-threaded GEMMs


@dataclass(frozen=True)
class OpWeights:
    """``fused_moe_packed``'s weight arguments: per expert, the up (w13) and down (w2) packs, and
    on the MKL route the shape-only weights the packed sgemm also takes (empty on oneDNN's)."""
    up: list[torch.Tensor]
    down: list[torch.Tensor]
    up_origin: list[torch.Tensor]
    down_origin: list[torch.Tensor]
    route: int
    compute: torch.dtype
    inter: int


def _pack(weight: torch.Tensor) -> SimpleNamespace:
    """One expert's [out, in] weight as the cpu linear op's prepared layer; on MKL's route its
    plain weight becomes shape-only (all the packed sgemm reads of it)."""
    layer = SimpleNamespace(weight=weight.contiguous(), bias=None)
    cpu_ops.linear_prepare(layer)
    if getattr(layer, "mkl_weight", None) is not None:
        layer.weight = cpu_ops.shape_only_weight(weight)
    return layer


def op_weights(up: list[SimpleNamespace], down: list[SimpleNamespace],
               inter: int) -> OpWeights | None:
    """The C++ op's arguments for these prepared experts, or None where they are not all packed
    the same way (no oneDNN: plain F.linear, which only the Python path runs)."""
    layers = up + down
    if all(getattr(p, "mkl_weight", None) is not None for p in layers):
        return OpWeights([p.mkl_weight for p in up], [p.mkl_weight for p in down],
                         [p.mkl_shape_weight for p in up], [p.mkl_shape_weight for p in down],
                         ROUTE_MKL, torch.float32, inter)
    if all(getattr(p, "packed_weight", None) is not None and p.packed_bias is None
           for p in layers):
        compute = {p.compute_dtype for p in layers}
        if len(compute) == 1:
            return OpWeights([p.packed_weight for p in up], [p.packed_weight for p in down],
                             [], [], ROUTE_ONEDNN, compute.pop(), inter)
    return None


def _release(part: torch.Tensor, packs: list[SimpleNamespace]) -> None:
    """Free ``part``'s storage (only the packs are read from now on): the oneDNN packs drop their
    views of it and the parameter becomes shape-only."""
    for p in packs:
        if getattr(p, "mkl_weight", None) is None:
            p.weight = None
    part.data = cpu_ops.shape_only_weight(part, part.dtype)
    setattr(part, RELEASED, True)


@functools.lru_cache(maxsize=None)
def parallel_experts() -> bool:
    """Whether oneDNN's route runs the experts hit in parallel (read once per process)."""
    return envs.PAGEDLLM_CPU_MOE_PARALLEL


def fused_moe_prepare(experts: nn.Module) -> None:
    """Pack every expert of ``experts`` (moe.FusedExperts: w13 [E, 2I, H], w2 [E, H, I]) once
    (a second call finds them packed); ``fused_moe`` releases the unpacked weights at its first
    call (see the module doc)."""
    w13, w2 = experts.w13.weight, experts.w2.weight
    if getattr(w13, PACKED, None) is not None and getattr(w2, PACKED, None) is not None:
        return
    for part in (w13, w2):
        setattr(part, PACKED, [_pack(part.data[e]) for e in range(part.shape[0])])
    weights = op_weights(getattr(w13, PACKED), getattr(w2, PACKED), w2.shape[-1])
    setattr(w13, OP_WEIGHTS, weights)
    setattr(w13, RELEASE_PENDING, weights is not None and not cpu_ops.keep_unpacked_weights())


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """``fused_moe`` on packed experts: one C++ call where the kernels load, else the grouped
    Python loop on the packs; unpacked weights (no prepare) take ``fused_moe_grouped``."""
    up, down = getattr(w13, PACKED, None), getattr(w2, PACKED, None)
    if up is None or down is None or hidden.dtype != w13.dtype:
        if getattr(w13, RELEASED, False):
            raise ValueError(f"fused_moe: hidden dtype {hidden.dtype} differs from the packed "
                             f"experts' {w13.dtype}, whose unpacked weights were released; "
                             f"pass {w13.dtype} input")
        return fused_moe_grouped(hidden, w13, w2, gating_output, topk, renormalize)
    check_shapes(hidden, w13, w2, gating_output, topk)
    if getattr(w13, RELEASE_PENDING, False):
        _release(w13, up)
        _release(w2, down)
        setattr(w13, RELEASE_PENDING, False)
    weights: OpWeights | None = getattr(w13, OP_WEIGHTS, None)
    kernels = (optional_cpu_kernels("fused_moe runs its Python loop over the packed experts",
                                    MOE) if weights is not None else False)
    if kernels:
        return kernels.fused_moe_packed(
            hidden, gating_output, topk, renormalize, weights.up, weights.down,
            weights.up_origin, weights.down_origin, weights.route, weights.compute,
            weights.inter, weights.route == ROUTE_ONEDNN and parallel_experts())
    return fused_moe_python(hidden, w13, w2, gating_output, topk, renormalize)


def fused_moe_python(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """The packed experts through ``run_grouped`` (what the C++ op computes, one op at a time)."""
    up, down = getattr(w13, PACKED), getattr(w2, PACKED)
    check_shapes(hidden, w13, w2, gating_output, topk)
    inter = w2.shape[-1]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        h = cpu_ops.linear(x, up[e])  # [n, 2I]: gate, then up
        return cpu_ops.linear(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], down[e])

    return run_grouped(hidden, gating_output, topk, renormalize, w13.shape[0], expert)
