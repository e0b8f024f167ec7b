"""GPTQ checkpoints as GPTQModel / AutoGPTQ write them (4- and 8-bit, sym and asym, desc_act).

Per linear, with G groups of ``group_size`` input columns (G = 1 for group_size -1):
  ``qweight`` int32 [in * bits / 32, out]  codes packed along the input dim, lowest bits first
  ``qzeros``  int32 [G, out * bits / 32]   zero points packed along the output dim
  ``scales``  fp16  [G, out]
  ``g_idx``   int32 [in]                   group of each input column (act order under desc_act)
Format "gptq" (v1, the default) stores each zero point minus one, subtracted from the packed
word (0x11111111 for 4 bits); "gptq_v2" stores them as they are. Dequantized:
w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o].
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.layers.quantization.base import (QuantizationConfig, config_value,
                                                     group_by_module, unpack_int32)

METHOD = "gptq"


def v1_zero_offset(bits: int) -> int:
    """What v1 subtracted from each packed zero word: 1 in every field."""
    return sum(1 << s for s in range(0, 32, bits))


class GPTQConfig(QuantizationConfig):
    name = METHOD

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v1: bool) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.has_g_idx = desc_act
        self.sym = sym
        self.v1 = v1

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GPTQConfig:
        bits = config_value(cfg, "bits", (4, 8), method=METHOD)
        gs = config_value(cfg, "group_size", method=METHOD)
        if not isinstance(gs, int) or (gs != -1 and gs <= 0):
            raise ValueError(f"quantization_config.group_size={gs!r} is invalid for gptq: a "
                             f"positive integer or -1 (one group per row)")
        desc_act = config_value(cfg, "desc_act", (True, False), default=False, method=METHOD)
        sym = config_value(cfg, "sym", (True, False), default=True, method=METHOD)
        fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported; "
                             f"supported: 'gptq', 'gptq_v2'")
        if cfg.get("dynamic"):
            raise ValueError("quantization_config.dynamic (per-module overrides) is not supported")
        return cls(bits, 0 if gs == -1 else gs, bool(desc_act), bool(sym), fmt == "gptq")

    def describe(self) -> str:
        return (f"gptq {self.bits}-bit, group {self.group_size or 'per channel'}, "
                f"{'sym' if self.sym else 'asym'}{', desc_act' if self.desc_act else ''}")

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        return group_by_module(weights, ("qweight", "qzeros", "scales"), ("g_idx",), self._module)

    def _module(self, module: str, t: dict[str, torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        codes = unpack_int32(t["qweight"], self.bits, dim=0).t().contiguous()  # [out, in]
        out, inp = codes.shape
        qzeros = t["qzeros"].to(torch.int64)
        if self.v1:  # undo the per-field "minus one", carries included (word arithmetic mod 2^32)
            qzeros = (qzeros + v1_zero_offset(self.bits)) & 0xFFFFFFFF
        zeros = unpack_int32(qzeros, self.bits, dim=1)[:, :out].t().float()  # [out, G]
        scales = t["scales"].to(torch.float32).t()  # [out, G]
        groups = 1 if self.group_size == 0 else inp // self.group_size
        if scales.shape != (out, groups) or zeros.shape != (out, groups):
            raise ValueError(f"{module}: scales {tuple(t['scales'].shape)} / qzeros "
                             f"{tuple(t['qzeros'].shape)} do not fit {groups} groups of "
                             f"group_size={self.group_size} over {inp} inputs")
        yield f"{module}.weight", codes
        yield f"{module}.quant.scale", scales.contiguous()
        yield f"{module}.quant.zero", zeros.contiguous()
        if self.desc_act:
            if "g_idx" not in t:
                raise ValueError(f"{module}.g_idx is missing (desc_act=True needs it)")
            yield f"{module}.quant.g_idx", t["g_idx"].to(torch.int32)
        elif "g_idx" in t and self.group_size:
            expected = torch.arange(inp, dtype=torch.int32) // self.group_size
            if not torch.equal(t["g_idx"].to(torch.int32), expected):
                raise ValueError(f"{module}.g_idx is not in column order but "
                                 f"quantization_config.desc_act=False")
