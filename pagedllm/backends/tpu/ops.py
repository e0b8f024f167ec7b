"""Model ops the tpu backend replaces: the torch reference, made safe for torch_xla's
inference-mode rule."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """``F.linear``. Under inference_mode torch_xla refuses to take a view (here ``weight.t()``)
    of a tensor created outside it ("Cannot set version_counter for inference tensor"); the
    engine loads weights under inference_mode, but weights made outside it (tests, user
    modules) are handled by leaving inference mode for this op."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    if torch.is_inference_mode_enabled() and not weight.is_inference():
        with torch.inference_mode(False):
            return F.linear(x, weight, bias)
    return F.linear(x, weight, bias)
