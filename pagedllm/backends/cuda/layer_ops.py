"""The model ops rms_norm / rotary / silu_and_mul / linear (models/layers/ops.py) on the csrc/
layer kernels.

float16 and bfloat16 tensors run the fused kernels; any other dtype runs the torch reference
unchanged (float32 is the path whose greedy output must equal transformers token for token). The
extension module is bound once, so a call costs one dtype test on top of the kernel; arguments are
checked by the C++ binding only (the model passes well-formed tensors; ops.py has the checked
public wrappers).

linear: on sm_90+ GPUs a one-token input (the decode steps of batch 1) runs the csrc/ GEMV,
which starts streaming its weights while the previous kernel finishes (gemv_kernels.cu); larger
inputs, other GPUs, and every input when PAGEDLLM_GEMV=0 run F.linear (cuBLAS / hipBLAS).
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.reference import ops as reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
GEMV_MAX_K = 16384  # csrc/ops.h kGemvMaxK


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

    def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
        weight, bias = layer.weight, getattr(layer, "bias", None)
        if (x.dim() == 2 and x.shape[0] == 1 and x.dtype in KERNEL_DTYPES
                and weight.dtype == x.dtype and weight.is_contiguous() and x.is_contiguous()
                and x.shape[1] % 8 == 0 and x.shape[1] <= GEMV_MAX_K
                and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0):
            return kernels.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    ops = {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul}
    # The GEMV beats cuBLAS only where it streams through bulk copies and starts early (sm_90+).
    # (A kernel module without kernel_arch, e.g. the tests' SIMT emulator, has no GEMV.)
    arch = getattr(kernels, "kernel_arch", lambda: 0)()
    if arch >= 900 and envs.PAGEDLLM_GEMV:
        ops["linear"] = linear
    return ops
