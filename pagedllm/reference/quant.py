"""Reference arithmetic of a quantized linear (the op table's ``quant_linear``): dequantize
the canonical layout (contract/quantization.py; built by models/layers/quantization/base.py) to
float32 and multiply in float32. Backends replace it with
kernels; the conformance suite compares those with this."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN, FP8_MAX


def column_groups(layer: Any) -> torch.Tensor | None:
    """[in] int64 group of each input column, or None where one scale covers a row."""
    q = layer.quant
    if q.g_idx is not None:
        return q.g_idx.long()
    if q.group_size == 0:
        return None
    cols = torch.arange(layer.weight.shape[1], device=layer.weight.device)
    return cols // q.group_size


def dequantize_weight(layer: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layer's weight [out, in] in ``dtype``: (code - zero) * scale per group."""
    q = layer.quant
    w = layer.weight.to(dtype)
    scale, zero = q.scale.to(dtype), None if q.zero is None else q.zero.to(dtype)
    groups = column_groups(layer)
    if groups is not None:  # [out, G] -> [out, in]
        scale = scale[:, groups]
        zero = None if zero is None else zero[:, groups]
    if zero is not None:
        w = w - zero
    return w * scale


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded through float8_e4m3fn with a scale per row (amax / 448), back in x's dtype:
    what a W8A8 kernel multiplies (its result is exact in float32 before the scales)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def quant_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype; float32 arithmetic."""
    xf = x.float()
    if layer.quant.act == ACT_FP8_PER_TOKEN:
        xf = fp8_per_token(xf)
    bias = getattr(layer, "bias", None)
    y = F.linear(xf, dequantize_weight(layer), None if bias is None else bias.float())
    return y.to(x.dtype)


def quant_linear_prepare(layer: torch.nn.Module) -> None:
    """Called once per quantized linear after loading (a backend re-packs its weights here)."""
