"""The model ops rms_norm / rotary / silu_and_mul / linear (models/layers/ops.py) on csrc/ kernels.

float16 and bfloat16 tensors run the fused kernels; any other dtype runs the torch reference
unchanged (float32 is the path whose greedy output must equal transformers token for token).
``linear`` runs the gemv kernel for decode batches of at most GEMV_MAX_ROWS rows and F.linear
(cuBLAS) otherwise. The extension module is bound once, so a call costs a few attribute tests on
top of the kernel; arguments are checked by the C++ binding only (the model passes well-formed
tensors; ops.py has the checked public wrappers). Nothing here synchronizes or allocates beyond
the output tensors, so the ops can be captured in CUDA graphs.
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from pagedllm.models.layers import ops as reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# Rows of x (tokens) up to which ``linear`` runs the gemv kernel; the kernel takes up to 8.
GEMV_MAX_ROWS = 8


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether kernels.gemv takes F.linear(x, weight, bias) when the tensors are on the GPU: a
    16-bit batch of at most GEMV_MAX_ROWS rows, k a multiple of 8, contiguous 16-byte aligned
    x and weight, one dtype."""
    k = x.shape[-1]
    return (x.dtype in KERNEL_DTYPES and k > 0 and k % 8 == 0
            and x.numel() <= GEMV_MAX_ROWS * k and x.is_contiguous() and x.data_ptr() % 16 == 0
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == k
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.stride(-1) == 1)))


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
        weight, bias = layer.weight, getattr(layer, "bias", None)  # weight [n, k], bias [n]
        if not (x.is_cuda and gemv_fits(x, weight, bias)):
            return reference.linear(x, layer)
        n, k = weight.shape
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)  # [..., n]
        kernels.gemv(out.view(-1, n), x.view(-1, k), weight, bias)
        return out

    return {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul,
            "linear": linear}
