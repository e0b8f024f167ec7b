"""Random quantized linears in the canonical layout, one per layout a method produces, for the
conformance suite (pagedllm/testing/test_quant_linear.py) and kernel tests."""
from __future__ import annotations

import types

import torch
from torch import nn

from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN, ACT_NONE, FP8_MAX
from pagedllm.models.layers.quantization.base import QuantizationConfig, QuantParams


class SyntheticMethod(QuantizationConfig):
    name = "synthetic"

    def __init__(self, weight_dtype: torch.dtype, bits: int, group_size: int, has_zero: bool,
                 g_idx: bool, act: str) -> None:
        self.weight_dtype, self.bits, self.group_size = weight_dtype, bits, group_size
        self.has_zero, self.has_g_idx, self.act = has_zero, g_idx, act


# method -> {layout name: (weight dtype, bits, group size (0: per channel), sym, act order, act)}
LAYOUTS: dict[str, dict[str, tuple]] = {
    "gptq": {"int4-g32-asym": (torch.uint8, 4, 32, False, False, ACT_NONE),
             "int4-g32-act-order": (torch.uint8, 4, 32, True, True, ACT_NONE),
             "int8-channel-sym": (torch.uint8, 8, 0, True, False, ACT_NONE)},
    "awq": {"int4-g64-asym": (torch.uint8, 4, 64, False, False, ACT_NONE)},
    "compressed-tensors": {"w4a16-g32": (torch.uint8, 4, 32, True, False, ACT_NONE),
                           "w8a16-g32": (torch.uint8, 8, 32, True, False, ACT_NONE),
                           "fp8-w8a8-dynamic": (torch.float8_e4m3fn, 8, 0, True, False,
                                                ACT_FP8_PER_TOKEN)},
    "fp8": {"fp8-channel": (torch.float8_e4m3fn, 8, 0, True, False, ACT_NONE)},
}


class SyntheticLinear(nn.Module):
    """What LinearBase holds under a quantized checkpoint (one rank, no bias)."""

    splits_input = False

    def __init__(self, layout: tuple, out: int, inp: int, dtype: torch.dtype,
                 device: torch.device, seed: int) -> None:
        super().__init__()
        wdtype, bits, gs, sym, act_order, act = layout
        method = SyntheticMethod(wdtype, bits, gs, wdtype == torch.uint8, act_order, act)
        self.ctx = types.SimpleNamespace(tp=types.SimpleNamespace(size=1, rank=0), device=device,
                                         dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        if wdtype == torch.uint8:
            levels = 1 << bits
            codes = torch.randint(0, levels, (out, inp), generator=gen).to(torch.uint8)
        else:
            codes = (torch.randn(out, inp, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX) \
                .to(torch.float8_e4m3fn)
        self.weight = nn.Parameter(codes.to(device), requires_grad=False)
        self.bias = None
        self.quant = QuantParams(self, inp, out, method)
        q = self.quant
        q.scale.data = (torch.rand(q.scale.shape, generator=gen) * 0.02 + 1e-3).to(device)
        if q.zero is not None:
            zero = (torch.full(q.scale.shape, float(levels // 2)) if sym else
                    torch.randint(0, levels, q.scale.shape, generator=gen).float())
            q.zero.data = zero.to(device)
        if q.g_idx is not None:
            q.g_idx.data = (torch.randperm(inp, generator=gen) // gs).to(torch.int32).to(device)
