"""Faster CPU ops: oneDNN (mkldnn) linear with weights pre-packed once at load time.

Half-precision models on CPUs without native bf16/fp16 matrix instructions (AVX2 only): oneDNN
refuses them and torch's fallback GEMM runs ~20x slower than fp32. There the weights are packed
as float32 (their values are exactly representable) and the input is upcast: products of half
values are exact in float32 and accumulation is in float32, as a native bf16 GEMM with fp32
accumulation does; the output is rounded back to the model dtype.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 64


@functools.lru_cache(maxsize=None)
def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a packed linear natively in ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none",
                                           [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def linear_prepare(layer: Any) -> None:
    weight = layer.weight.data
    compute = weight.dtype if onednn_linear_supported(weight.dtype) else torch.float32
    if not onednn_linear_supported(compute):
        return  # no oneDNN: plain F.linear
    bias = getattr(layer, "bias", None)
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute),
                                                                  _PACK_BATCH_HINT)
    layer.packed_bias = bias.data.to(compute) if bias is not None else None
    layer.compute_dtype = compute


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, getattr(layer, "bias", None))
    if x.dtype == layer.compute_dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.packed_bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(x.to(layer.compute_dtype), packed, layer.packed_bias,
                                           "none", [], "")
    return y.to(x.dtype)
