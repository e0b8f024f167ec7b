"""Quantized linears on cuda/rocm.

FP8 weights (compressed-tensors FP8, ``quantization="fp8"``) run ``torch._scaled_mm``: the
activations are quantized to e4m3 per token on the fly (as vLLM's fp8 linear does; for the W8A8
checkpoints that is the checkpoint's own scheme), the weight keeps its per-channel scales, the
product accumulates in float32 and is scaled and rounded to the model dtype once. Where
``_scaled_mm`` does not run (a GPU without FP8 tensor cores, or shapes not multiples of 16) the
reference dequantize-and-multiply stays.

4-bit layouts with groups in column order (GPTQ without act order, AWQ, compressed-tensors W4A16)
run csrc/quantization's GEMV (up to 8 rows) and tiled GEMM (``pagedllm._C.int4_linear``) on the
layout ``int4_gpu_layout`` makes once at load (the codes are then dropped); other integer
layouts run the reference.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN, FP8_MAX
from pagedllm.models.layers.quantization.base import pack_int32
from pagedllm.reference.quant import quant_linear as reference_quant_linear

logger = logging.getLogger(__name__)


def int4_gpu_layout(layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A canonical 4-bit linear (codes [N, K] in column order) -> csrc/quantization's layout:
    (qweight int32 [N, K / 8] holding input 8 w + j in bits [4 j, 4 j + 4) of word w,
    scales float32 [N, G], offsets float32 [N, G] = -zero * scale)."""
    q = layer.quant
    if q.g_idx is not None or not q.group_size:
        raise ValueError("the int4 kernels take groups in column order (no act-order g_idx)")
    qweight = pack_int32(layer.weight.to(torch.int64), 4, dim=1).contiguous()
    scales = q.scale.float().contiguous()
    offsets = (-q.zero.float() * scales).contiguous()
    return qweight, scales, offsets


def torch_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 codes [T, K], float32 scales [T, 1]): dynamic per-token quantization
    (scale = amax / 448), as ``reference.fp8_per_token`` rounds it."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [T, 1]
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_fp8_rows`` in one Triton launch on a GPU (triton_fp8.py, bit-identical); the
    torch ops elsewhere (``meta`` included)."""
    if x.is_cuda:
        from pagedllm.backends.cuda.triton_fp8 import fp8_rows as triton_fp8_rows

        return triton_fp8_rows(x)
    return torch_fp8_rows(x)


# Routes: what a layer's layout allows (pure, any device) and what this machine runs (hardware).
def fp8_layout_ok(layer: nn.Module) -> bool:
    w = layer.weight
    return w.dtype == torch.float8_e4m3fn and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def int4_layout_ok(layer: nn.Module) -> bool:
    q, w = layer.quant, layer.weight
    return (w.dtype == torch.uint8 and q.method.bits == 4 and q.g_idx is None
            and q.zero is not None and q.act == "none" and q.group_size > 0
            and q.group_size % 32 == 0 and w.shape[1] % q.group_size == 0)


@functools.lru_cache(maxsize=None)
def _scaled_mm_runs(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89+, MI300) behind ``torch._scaled_mm``: a tiny product."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        a = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("torch._scaled_mm does not run here (%s); FP8 linears run the reference", exc)
        return False


@functools.lru_cache(maxsize=None)
def _kernels() -> Any:
    """pagedllm._C (built on first use) where it has int4_linear, else None."""
    try:
        from pagedllm.backends.cuda import ops as kernel_ops

        ok, reason = kernel_ops.kernels_available(build=True)
        if not ok:
            logger.info("csrc/ kernels unavailable (%s); 4-bit linears run the reference", reason)
            return None
        kernels = kernel_ops.load_kernels()
        return kernels if hasattr(kernels, "int4_linear") else None
    except (ImportError, RuntimeError, OSError) as exc:
        logger.info("csrc/ kernels unavailable (%s); 4-bit linears run the reference", exc)
        return None


def choose_route(layer: nn.Module) -> str:
    """"fp8", "int4" or "reference" for this layer on this machine."""
    w = layer.weight
    if w.is_cuda and fp8_layout_ok(layer) and _scaled_mm_runs(w.device):
        return "fp8"
    if w.is_cuda and int4_layout_ok(layer) and _kernels() is not None:
        return "int4"
    return "reference"


def prepare_route(layer: nn.Module, route: str) -> None:
    """Re-lays ``layer`` out for ``route``; device-agnostic (every tensor made here lives on the
    weight's device, which tests/quantization checks on ``meta``)."""
    layer.cuda_fp8, layer.cuda_int4 = route == "fp8", None
    if route == "fp8":
        layer.cuda_fp8_scale = layer.quant.scale.float().reshape(1, -1).contiguous()  # [1, N]
        # activations are quantized per token (W8A8): the conformance suite compares with that
        layer.act_quant = ACT_FP8_PER_TOKEN
    elif route == "int4":
        qweight, scales, offsets = int4_gpu_layout(layer)
        layer.cuda_int4 = (qweight, scales, offsets, layer.quant.group_size)
        layer.cuda_out_features = layer.weight.shape[0]
        # the codes are no longer read: a 0-element placeholder of the same dtype
        layer.weight = nn.Parameter(layer.weight.data.new_empty((0, layer.weight.shape[1])),
                                    requires_grad=False)
    elif route != "reference":
        raise ValueError(f"route={route!r}; allowed: 'fp8', 'int4', 'reference'")


def quant_linear_prepare(layer: nn.Module) -> None:
    prepare_route(layer, choose_route(layer))


def fp8_linear(x2: torch.Tensor, layer: Any) -> torch.Tensor:
    """x2 [T, K] -> [T, N] through ``torch._scaled_mm`` (float32 accumulation, one rounding)."""
    xq, scale_x = fp8_rows(x2)
    out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.float32
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=scale_x, scale_b=layer.cuda_fp8_scale,
                            out_dtype=out_dtype)


def quant_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype."""
    int4 = getattr(layer, "cuda_int4", None)
    if int4 is not None:
        qweight, scales, offsets, group_size = int4
        y = _kernels().int4_linear(x.reshape(-1, x.shape[-1]).contiguous(), qweight, scales,
                                   offsets, group_size)
        bias = getattr(layer, "bias", None)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], layer.cuda_out_features)
    if not getattr(layer, "cuda_fp8", False):
        return reference_quant_linear(x, layer)
    y = fp8_linear(x.reshape(-1, x.shape[-1]), layer)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def register(ops: Any) -> None:
    ops.register("quant_linear", quant_linear)
    ops.register("quant_linear_prepare", quant_linear_prepare)
