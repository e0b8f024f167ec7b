"""The model ops rms_norm / gemma_rms_norm / rotary / silu_and_mul / gelu_tanh_and_mul /
greedy_logprobs (models/layers/ops.py) on the csrc/cpu kernels (layer_ops_cpu.cpp,
sampling_cpu.cpp): one pass each for 2-D/3-D inputs whose
tensors all have one dtype among float32, bfloat16 and float16 (greedy_logprobs: float32 logits,
as the model runner hands them); the torch reference for anything else (mixed dtypes, other
ranks).

The kernels round every value the reference materializes in bf16/fp16 to that dtype, op by op.
rotary is bit-identical to the reference in every dtype, and so is silu_and_mul where torch runs
its AVX2 CPU kernels (the ISA these are built for; torch's AVX-512 exp may round an ulp the other
way); gelu_tanh_and_mul (bf16/fp16; float32 runs the reference) computes torch's formula in float32
with a polynomial-exp tanh (csrc/cpu/vec_math.h; Sleef's tanhf was ~70% of its time), so a value
may be one rounding of the dtype away from the reference (~97% are bit-equal); rms_norm and gemma_rms_norm sum their squares in another order than torch's mean, so a normalized value may
differ in the last bit of the dtype. greedy_logprobs is torch's argmax and log_softmax
arithmetic (bit-identical). The kernels check their arguments (RuntimeError naming the
argument).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.reference import ops as reference

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_ops(kernels: Any) -> dict[str, Callable[..., Any]]:
    """{op name: function} for ``Ops.register``; ``kernels`` is torch.ops.pagedllm_cpu."""
    dtypes = KERNEL_DTYPES

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype in dtypes and weight.dtype == x.dtype and x.dim() == 2
                and (residual is None or residual.dtype == x.dtype)):
            return kernels.rms_norm(x, weight, eps, residual)
        return reference.rms_norm(x, weight, eps, residual)

    def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype in dtypes and weight.dtype == x.dtype and x.dim() == 2
                and (residual is None or residual.dtype == x.dtype)):
            return kernels.gemma_rms_norm(x, weight, eps, residual)
        return reference.gemma_rms_norm(x, weight, eps, residual)

    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype in dtypes and cos.dtype == x.dtype and sin.dtype == x.dtype and x.dim() == 3:
            return kernels.rotary(x, cos, sin)
        return reference.rotary(x, cos, sin)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dtype in dtypes and x.dim() == 2:
            return kernels.silu_and_mul(x)
        return reference.silu_and_mul(x)

    def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
        # float32: the reference (torch's build may fuse a product of its GELU into an FMA: an
        # ulp apart); bf16/fp16: the kernel, bit-identical
        if x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2:
            return kernels.gelu_tanh_and_mul(x)
        return reference.gelu_tanh_and_mul(x)

    def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0
                and logits.stride(1) == 1):
            return kernels.greedy_logprobs(logits)
        return reference.greedy_logprobs(logits)

    return {"rms_norm": rms_norm, "gemma_rms_norm": gemma_rms_norm, "rotary": rotary,
            "silu_and_mul": silu_and_mul, "gelu_tanh_and_mul": gelu_tanh_and_mul,
            "greedy_logprobs": greedy_logprobs}
