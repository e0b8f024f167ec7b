"""AWQ checkpoints as AutoAWQ writes them ("gemm" version, 4-bit), and GPTQModel's AWQ.

Per linear, with G groups of ``group_size`` input columns:
  ``qweight`` int32 [in, out / 8]  codes packed along the output dim
  ``qzeros``  int32 [G, out / 8]   zero points, packed the same way
  ``scales``  fp16  [G, out]
Within a word, field i (bits 4i..4i+3) holds output column ``AWQ_ORDER[i]`` of its run of 8
(AutoAWQ's interleave). Dequantized: w[o, i] = (q[i, o] - z[i // group_size, o]) * s[..., o].
zero_point=False (symmetric; GPTQModel writes it with sym=True) keeps the same formula: its
``qzeros`` hold 8 in every field, and a checkpoint without ``qzeros`` gets 8 (the midpoint).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.layers.quantization.base import (QuantizationConfig, config_value,
                                                     group_by_module, unpack_int32)

METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word field i -> column offset within 8 columns
GROUP_SIZES = (32, 64, 128)


class AWQConfig(QuantizationConfig):
    name = METHOD
    bits = 4

    def __init__(self, group_size: int, zero_point: bool = True) -> None:
        self.group_size = group_size
        self.zero_point = zero_point

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AWQConfig:
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config.bits={bits!r} is not supported for awq; "
                             f"supported: 4")
        gs = cfg.get("group_size", cfg.get("q_group_size"))
        if gs not in GROUP_SIZES:
            raise ValueError(f"quantization_config.group_size={gs!r} is not supported for awq; "
                             f"supported: {', '.join(map(str, GROUP_SIZES))}")
        zero_point = config_value(cfg, "zero_point", (True, False), default=True, method=METHOD)
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={version!r} is not supported for awq; "
                             f"supported: 'gemm'")
        return cls(gs, zero_point)

    def describe(self) -> str:
        return f"awq 4-bit gemm, group {self.group_size}{'' if self.zero_point else ', symmetric'}"

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_point:
            return group_by_module(weights, ("qweight", "qzeros", "scales"), (), self._module)
        return group_by_module(weights, ("qweight", "scales"), ("qzeros",), self._module)

    def _module(self, module: str, t: dict[str, torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        codes = unpack_int32(t["qweight"], 4, dim=1, order=AWQ_ORDER).t().contiguous()  # [out, in]
        out, inp = codes.shape
        scales = t["scales"].to(torch.float32).t()
        groups = inp // self.group_size
        if "qzeros" in t:
            zeros = unpack_int32(t["qzeros"], 4, dim=1, order=AWQ_ORDER).t().float()  # [out, G]
        else:  # zero_point=False without qzeros: the midpoint
            zeros = torch.full((out, groups), 8.0, device=codes.device)
        if scales.shape != (out, groups) or zeros.shape != (out, groups):
            raise ValueError(f"{module}: scales {tuple(t['scales'].shape)} / qzeros "
                             f"{tuple(t['qzeros'].shape)} do not fit {groups} groups of "
                             f"group_size={self.group_size} over {inp} inputs")
        yield f"{module}.weight", codes
        yield f"{module}.quant.scale", scales.contiguous()
        yield f"{module}.quant.zero", zeros.contiguous()
