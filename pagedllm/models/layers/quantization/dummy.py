"""Random quantized weights for ``load_format="dummy"`` (benchmarks without a checkpoint)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.quantization.base import QuantParams


def init_dummy_quantized(model: nn.Module, seed: int) -> None:
    """Codes uniform over their range with scales that keep weights within ~[-1e-3, 1e-3] (as
    the float dummy init), zero points mid-range, group indices in column order. Drawn on the
    weights' device (one generator per device, as the float dummy init): billions of codes of
    an 8B model take seconds there and minutes on one host thread."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in model.modules():
            q = getattr(module, "quant", None)
            if not isinstance(q, QuantParams):
                continue
            w = module.weight
            dev = w.device
            gen = gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed))
            if w.dtype == torch.uint8:
                levels = 1 << q.method.bits
                codes = torch.randint(0, levels, tuple(w.shape), generator=gen, dtype=torch.int32,
                                      device=dev)
                w.copy_(codes.to(torch.uint8))
                q.scale.fill_(2e-3 / levels)
                if q.zero is not None:
                    q.zero.fill_(levels // 2)
            elif w.dtype == torch.float8_e4m3fn:
                vals = torch.empty(tuple(w.shape), device=dev).uniform_(-448.0, 448.0, generator=gen)
                w.copy_(vals.to(torch.float8_e4m3fn))
                q.scale.fill_(1e-3 / 448.0)
            if q.g_idx is not None and q.group_size:
                q.g_idx.copy_(torch.arange(q.g_idx.shape[0], dtype=torch.int32, device=dev)
                              // q.group_size)
