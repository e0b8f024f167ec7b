"""The model ops rms_norm / rotary / silu_and_mul (models/layers/ops.py) on the csrc/cpu layer
kernels (layer_ops_cpu.cpp): one pass each for float32 2-D/3-D inputs, the torch reference for
anything else (bfloat16/float16 models keep the reference's float32 upcasts).

rotary is bit-identical to the reference, and so is silu_and_mul where torch runs its AVX2 CPU
kernels (the ISA these are built for; torch's AVX-512 exp may round an ulp the other way);
rms_norm sums its squares in another order than torch's mean, so a normalized value may differ in
the last float32 bit. The kernels check their arguments (RuntimeError naming the argument).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.models.layers import ops as reference


def layer_ops(kernels: Any) -> dict[str, Callable[..., Any]]:
    """{op name: function} for ``Ops.register``; ``kernels`` is torch.ops.pagedllm_cpu."""
    f32 = torch.float32

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == f32 and weight.dtype == f32 and x.dim() == 2:
            return kernels.rms_norm(x, weight, eps, residual)
        return reference.rms_norm(x, weight, eps, residual)

    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype == f32 and cos.dtype == f32 and sin.dtype == f32 and x.dim() == 3:
            return kernels.rotary(x, cos, sin)
        return reference.rotary(x, cos, sin)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == f32 and x.dim() == 2:
            return kernels.silu_and_mul(x)
        return reference.silu_and_mul(x)

    return {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul}
