"""compressed-tensors checkpoints, as llm-compressor writes them.

Supported (one config group targeting Linear layers; ``ignore`` may list unquantized modules
such as lm_head, which pagedllm never quantizes):
  - FP8 W8A8 ("float-quantized"): float8_e4m3fn ``weight`` with a per-tensor or per-channel
    ``weight_scale``; activations either unquantized or dynamic per token (FP8_DYNAMIC).
  - W4A16 / W8A16 ("pack-quantized"): int32 ``weight_packed`` (values + 2^(bits-1), lowest bits
    first along the input dim), ``weight_scale`` [out, G], ``weight_shape``, and for asymmetric
    schemes ``weight_zero_point`` packed along the output dim.
  - W8A16 ("naive-quantized" / "int-quantized"): int8 ``weight`` + ``weight_scale``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN, ACT_NONE
from pagedllm.models.layers.quantization.base import (QuantizationConfig, config_value,
                                                      expand_scale, group_by_module, unpack_int32)

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "pack-quantized", "naive-quantized", "int-quantized")
STRATEGIES = ("tensor", "channel", "group")


class CompressedTensorsConfig(QuantizationConfig):
    name = METHOD

    def __init__(self, fmt: str, weight_type: str, bits: int, strategy: str, group_size: int,
                 symmetric: bool, act: str) -> None:
        self.format = fmt
        self.weight_type = weight_type
        self.bits = bits
        self.strategy = strategy
        self.group_size = group_size if strategy == "group" else 0
        self.symmetric = symmetric
        self.act = act
        self.weight_dtype = torch.float8_e4m3fn if weight_type == "float" else torch.uint8
        self.has_zero = weight_type == "int"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> CompressedTensorsConfig:
        groups = config_value(cfg, "config_groups", method=METHOD)
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(f"quantization_config.config_groups must hold exactly one scheme "
                             f"(got {len(groups) if isinstance(groups, dict) else groups!r})")
        gname, group = next(iter(groups.items()))
        where = f"config_groups.{gname}"
        fmt = group.get("format") or config_value(cfg, "format", FORMATS, method=METHOD)
        if fmt not in FORMATS:
            raise ValueError(f"quantization_config.{where}.format={fmt!r} is not supported; "
                             f"supported: {', '.join(FORMATS)}")
        targets = group.get("targets") or []
        if "Linear" not in targets:
            raise ValueError(f"quantization_config.{where}.targets={targets!r} must include "
                             f"'Linear'")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"quantization_config.{where}.weights is missing")
        wwhere = f"{where}.weights"
        wtype = config_value(w, "type", ("int", "float"), method=METHOD, where=wwhere)
        bits = config_value(w, "num_bits", (4, 8) if wtype == "int" else (8,), method=METHOD,
                            where=wwhere)
        strategy = config_value(w, "strategy", STRATEGIES, method=METHOD, where=wwhere)
        if w.get("dynamic"):
            raise ValueError(f"quantization_config.{where}.weights.dynamic=True is not supported")
        gs = 0
        if strategy == "group":
            gs = config_value(w, "group_size", method=METHOD, where=wwhere)
            if not isinstance(gs, int) or gs <= 0:
                raise ValueError(f"quantization_config.{where}.weights.group_size={gs!r} must be a "
                                 f"positive integer")
        symmetric = bool(w.get("symmetric", True))
        if wtype == "float" and (strategy == "group" or not symmetric):
            raise ValueError(f"quantization_config.{where}.weights: FP8 weights need "
                             f"strategy 'tensor' or 'channel' and symmetric=True")
        if wtype == "int" and fmt == "float-quantized":
            raise ValueError(f"quantization_config.format={fmt!r} does not hold int weights")
        act = cls._activations(group.get("input_activations"), where)
        if group.get("output_activations"):
            raise ValueError(f"quantization_config.{where}.output_activations is not supported")
        return cls(fmt, wtype, bits, strategy, gs, symmetric, act)

    @staticmethod
    def _activations(a: dict[str, Any] | None, where: str) -> str:
        if not a:
            return ACT_NONE
        ok = (a.get("type") == "float" and a.get("num_bits") == 8 and a.get("dynamic") is True
              and a.get("strategy") == "token")
        if not ok:
            raise ValueError(f"quantization_config.{where}.input_activations={a!r} is not "
                             f"supported; only dynamic per-token FP8 (type 'float', num_bits 8, "
                             f"strategy 'token', dynamic true) or none")
        return ACT_FP8_PER_TOKEN

    def describe(self) -> str:
        kind = "FP8" if self.weight_type == "float" else f"INT{self.bits}"
        act = " + dynamic FP8 activations" if self.act != ACT_NONE else ""
        return f"{METHOD} {self.format} {kind} weights ({self.strategy}){act}"

    # --- checkpoint -> canonical -----------------------------------------------------------
    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        required: tuple[str, ...] = (("weight_packed" if self.format == "pack-quantized"
                                      else "weight"), "weight_scale")
        if not self.symmetric:
            required += ("weight_zero_point",)
        # a ``weight`` belongs to a quantized module only if it holds quantized values; float
        # ones (norms, embeddings, ignored layers) pass through. ``weight_shape`` is [out, in],
        # which the packed codes and the layer already tell.
        return group_by_module(weights, required, ("input_scale",), self._module,
                               claims=_claims, dropped=("weight_shape",))

    def _module(self, module: str, t: dict[str, torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        if "input_scale" in t:
            raise ValueError(f"{module}.input_scale: static activation scales are not supported")
        offset = 1 << (self.bits - 1)
        if self.format == "pack-quantized":
            codes = unpack_int32(t["weight_packed"], self.bits, dim=1)
            if self.strategy == "group":  # packing pads the input dim to whole words
                codes = codes[:, :t["weight_scale"].shape[-1] * self.group_size]
        elif self.weight_type == "float":
            codes = t["weight"].to(torch.float8_e4m3fn)
        else:  # int8 values in [-128, 127] -> uint8 codes with the offset in the zero point
            codes = (t["weight"].to(torch.int16) + offset).to(torch.uint8)
        out = codes.shape[0]
        scale = t["weight_scale"].to(torch.float32)
        scale = scale if self.strategy == "group" else expand_scale(scale, out)
        yield f"{module}.weight", codes
        yield f"{module}.quant.scale", scale.reshape(out, -1)
        if self.weight_type == "int":
            if self.symmetric:
                zero = torch.full_like(scale.reshape(out, -1), float(offset))
            elif self.format == "pack-quantized":
                zero = unpack_int32(t["weight_zero_point"], self.bits, dim=0)[:out].float()
            else:
                zero = t["weight_zero_point"].float().reshape(out, -1) + offset
            yield f"{module}.quant.zero", zero.reshape(out, -1)


def _claims(suffix: str, tensor: torch.Tensor) -> bool:
    return suffix != "weight" or tensor.dtype in (torch.float8_e4m3fn, torch.int8)
