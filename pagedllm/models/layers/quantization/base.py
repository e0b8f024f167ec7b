"""The quantized-linear contract: a checkpoint format's config turns its tensors into one
canonical layout that every backend's ``quant_linear`` op reads.

Canonical layout of a quantized linear with this rank's shard [out, in] (``LinearBase``):
  ``weight``         [out, in] codes: uint8 integers (dequantized as (code - zero) * scale) or
                     float8_e4m3fn values (dequantized as value * scale)
  ``quant.scale``    [out, G] float32; G = in / group_size, or 1 (a scale per output channel)
  ``quant.zero``     [out, G] float32 integer zero points (integer formats only)
  ``quant.g_idx``    [in] int32 group of each input column (GPTQ desc_act only; else
                     column // group_size)
A per-tensor scale is expanded to one per output channel (exact, and what lets fused q/k/v or
gate/up matrices keep each part's scale). Tensor-parallel sharding follows the weight: dim 0 for
column-parallel layers, the group dim for row-parallel ones.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

# what activations go through before the matmul (ACT_*), and the e4m3 range: the contract's
from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN, ACT_NONE, FP8_MAX  # noqa: F401


class QuantizationConfig:
    """One checkpoint format's settings, read from ``config.json``'s ``quantization_config``."""

    name: ClassVar[str]
    weight_dtype: torch.dtype = torch.uint8
    group_size: int = 0  # 0: one scale per output channel
    has_zero: bool = True
    has_g_idx: bool = False
    act: str = ACT_NONE
    bits: int = 8
    quantize_at_load: bool = False  # the checkpoint is float; weights are quantized after loading

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors -> canonical ones (see the module doc); others pass unchanged."""
        return iter(weights)

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once per quantized linear after loading, before the backend's prepare."""

    def describe(self) -> str:
        return f"{self.name} ({self.bits}-bit, group {self.group_size or 'per channel'})"


def config_value(cfg: dict[str, Any], key: str, allowed: Iterable[Any] | None = None,
                 default: Any = ..., method: str = "", where: str = "") -> Any:
    """``cfg[key]``, checked against ``allowed``; a missing or bad value names the field
    (``quantization_config.<where>.<key>``)."""
    name = f"quantization_config.{where + '.' if where else ''}{key}"
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ValueError(f"{name} is missing ({method} checkpoint)")
        return default
    value = cfg[key]
    if allowed is not None and value not in tuple(allowed):
        raise ValueError(f"{name}={value!r} is not supported for {method}; "
                         f"supported: {', '.join(map(repr, allowed))}")
    return value


def group_by_module(weights: Iterable[tuple[str, torch.Tensor]], required: tuple[str, ...],
                    optional: tuple[str, ...],
                    convert: Callable[[str, dict[str, torch.Tensor]],
                                      Iterator[tuple[str, torch.Tensor]]],
                    claims: Callable[[str, torch.Tensor], bool] = lambda suffix, t: True,
                    dropped: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collect ``<module>.<suffix>`` tensors per module and hand each complete set to
    ``convert(module, {suffix: tensor})``; optional suffixes seen before the last required one
    are included. Other tensors, and those ``claims(suffix, tensor)`` turns down (a float
    ``weight`` of an unquantized layer), pass through. A module left incomplete raises, naming
    what is missing. Tensors with a ``dropped`` suffix (redundant metadata) are skipped."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    suffixes = required + optional
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix in dropped:
            continue
        if suffix not in suffixes or not claims(suffix, tensor):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if all(s in parts for s in required):
            yield from convert(module, pending.pop(module))
    for module, parts in pending.items():
        missing = [s for s in required if s not in parts]
        raise ValueError(f"quantized module {module!r} lacks tensor(s) {', '.join(missing)} in the "
                         f"checkpoint")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values each, lowest bits first -> uint8 values,
    ``dim`` grown by 32 / bits. ``order[i]`` is where the i-th field of a word goes within its
    run of 32 / bits values (AutoAWQ's interleave); None: in place."""
    per = 32 // bits
    # constants live on the tensor's device: a host constant fails on a GPU (and on ``meta``)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per]
    p = packed.to(torch.int32).movedim(dim, -1)  # [..., n]
    vals = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, per]
    if order is not None:
        inverse = [0] * per
        for i, dst in enumerate(order):
            inverse[dst] = i
        vals = vals[..., inverse]
    return vals.reshape(*p.shape[:-1], p.shape[-1] * per).movedim(-1, dim).to(torch.uint8)


def pack_int32(values: torch.Tensor, bits: int, dim: int,
               order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (test checkpoints and backends that want packed words)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)  # [..., n, per]
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(-1)  # < 2^32
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


class QuantParams(nn.Module):
    """A quantized linear's scales, zero points and group index (the canonical layout), with the
    loader that shards them like the layer's weight."""

    def __init__(self, layer: nn.Module, in_local: int, out_local: int,
                 method: QuantizationConfig) -> None:
        super().__init__()
        self.method = method
        object.__setattr__(self, "_layer", layer)  # not a submodule (no cycle)
        tp = layer.ctx.tp
        gs = method.group_size
        splits_input = getattr(layer, "splits_input", False)
        in_total = in_local * tp.size if splits_input else in_local
        if gs and in_local % gs:
            raise ValueError(f"a linear's input size {in_local} (this rank's share) is not a "
                             f"multiple of quantization group_size={gs}")
        # row-parallel layers keep every group where columns may belong to any group (desc_act)
        # or where a scale spans all columns (per channel)
        self.replicated = splits_input and (gs == 0 or method.has_g_idx)
        groups = 1 if gs == 0 else (in_total if self.replicated else in_local) // gs
        dev = layer.ctx.device
        self.group_size = gs
        scale = torch.ones(out_local, groups, dtype=torch.float32, device=dev)
        if method.quantize_at_load:  # filled after loading, not from the checkpoint
            self.register_buffer("scale", scale)
        else:
            self.scale = nn.Parameter(scale, requires_grad=False)
        self.zero = (nn.Parameter(torch.zeros(out_local, groups, dtype=torch.float32, device=dev),
                                  requires_grad=False) if method.has_zero else None)
        self.g_idx = (nn.Parameter(torch.zeros(in_local, dtype=torch.int32, device=dev),
                                   requires_grad=False) if method.has_g_idx else None)
        self.act = method.act

    @property
    def layer(self) -> nn.Module:
        return self._layer  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        layer = self.layer
        if param is self.g_idx:
            if getattr(layer, "splits_input", False):
                n = param.shape[0]
                loaded = loaded.narrow(0, layer.ctx.tp.rank * n, n)
            elif shard_id is not None:
                # fused parts must agree; compared on the host (the parameter may be on a GPU)
                first = getattr(self, "_g_idx_first", None)
                if first is not None and not torch.equal(first, loaded.to(torch.int32)):
                    raise ValueError("the fused parts of a linear (q/k/v or gate/up) have "
                                     "different g_idx (act-order permutations); that is not "
                                     "supported")
                self._g_idx_first = loaded.to(torch.int32)
            layer._copy(param, loaded)
        elif self.replicated:
            layer._copy(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard_id)


def expand_scale(scale: torch.Tensor, out: int) -> torch.Tensor:
    """A per-tensor ([], [1]) or per-channel ([out], [out, 1]) scale -> [out, 1] float32."""
    s = scale.to(torch.float32).reshape(-1, 1)
    if s.shape[0] == 1:
        return s.expand(out, 1).contiguous()
    if s.shape[0] != out:
        raise ValueError(f"a weight scale of shape {tuple(scale.shape)} fits neither per-tensor "
                         f"nor per-channel scaling of {out} output channels")
    return s
