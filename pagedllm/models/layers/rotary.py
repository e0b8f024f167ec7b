"""Rotary position embedding tables, computed the way transformers computes them."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _rope_theta_and_type(config: Any) -> tuple[float, str, dict]:
    """Works with transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return float(params.get("rope_theta", 10000.0)), params.get("rope_type", "default"), params
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(getattr(config, "rope_theta", 10000.0)), rope_type, scaling


def inv_freq_and_scaling(config: Any, head_size: int) -> tuple[torch.Tensor, float]:
    theta, rope_type, _ = _rope_theta_and_type(config)
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_size] in the model dtype, gathered by position."""

    def __init__(self, config: Any, head_size: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inv_freq, scaling = inv_freq_and_scaling(config, head_size)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # elementwise, as transformers does
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype=dtype, device=device),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]
