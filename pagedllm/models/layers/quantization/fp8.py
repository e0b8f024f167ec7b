"""FP8 on the fly (``quantization="fp8"``): a float checkpoint whose linear weights are turned
into float8_e4m3fn with one scale per output channel (amax / 448) after loading; activations
stay in the model dtype (weight-only, like vLLM's fp8 method without activation scales on CPU).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.contract.quantization import FP8_MAX
from pagedllm.models.layers.quantization.base import QuantizationConfig


class Fp8Config(QuantizationConfig):
    name = "fp8"
    weight_dtype = torch.float8_e4m3fn
    group_size = 0
    has_zero = False
    quantize_at_load = True

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Fp8Config:
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported "
                             f"for fp8; supported: 'dynamic'")
        return cls()

    def process_after_loading(self, layer: nn.Module) -> None:
        quantize_layer_at_load(layer)

    def describe(self) -> str:
        return "fp8 (per-channel e4m3 weights quantized at load)"


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 values [out, in], float32 scales [out, 1])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_layer_at_load(layer: nn.Module) -> None:
    """Replace the layer's float weight by e4m3 values and fill ``quant.scale``."""
    values, scale = quantize_fp8_per_channel(layer.weight.data)
    layer.weight = nn.Parameter(values, requires_grad=False)
    layer.quant.scale.data.copy_(scale)
