"""Faster CPU ops: oneDNN (mkldnn) linear with weights pre-packed once at load time."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 64


def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """oneDNN packed fp32 linear; bf16 needs AVX-512/AMX/AVX-NE-CONVERT, so we try it first."""
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
    if layer.weight.dtype == torch.float32 or onednn_linear_supported(layer.weight.dtype):
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data,
                                                                      _PACK_BATCH_HINT)


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    packed = getattr(layer, "packed_weight", None)
    bias = getattr(layer, "bias", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
