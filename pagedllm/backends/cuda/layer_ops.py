"""The model ops rms_norm / rotary / silu_and_mul (models/layers/ops.py) on the csrc/ layer kernels.

float16 and bfloat16 tensors run the fused kernels; any other dtype runs the torch reference
unchanged (float32 is the path whose greedy output must equal transformers token for token). The
extension module is bound once, so a call costs one dtype test on top of the kernel; arguments are
checked by the C++ binding only (the model passes well-formed tensors; ops.py has the checked
public wrappers).
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from pagedllm.models.layers import ops as reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def layer_ops(kernels: ModuleType) -> dict[str, Callable[..., Any]]:
    """{op name: function} for ``Ops.register``; ``kernels`` is the loaded extension module."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype in KERNEL_DTYPES:
            return kernels.rms_norm(x, weight, eps, residual)
        return reference.rms_norm(x, weight, eps, residual)

    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype in KERNEL_DTYPES:  # x [T, heads, head_size], cos/sin [T, head_size]
            return kernels.rotary(x, cos, sin)
        return reference.rotary(x, cos, sin)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dtype in KERNEL_DTYPES:  # x [T, 2 * intermediate_size]
            return kernels.silu_and_mul(x)
        return reference.silu_and_mul(x)

    return {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul}
