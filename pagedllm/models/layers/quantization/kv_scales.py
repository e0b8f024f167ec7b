"""Per-tensor K/V cache scales a checkpoint may carry for kv_cache_dtype="fp8"
(``<attention>.k_scale`` / ``.v_scale``, as llm-compressor's kv_cache_scheme and vLLM's FP8
checkpoints write them; the older single ``.kv_scale`` sets both). They are taken out of the
weight stream and set on the attention layers' implementations after loading (default 1.0)."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUFFIXES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale")}


def split_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], found: dict[str, float]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the K/V scale tensors, which land in ``found`` as
    {"<attention module>.k_scale": value, ...}."""
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix not in SUFFIXES:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"{name}: a K/V cache scale must be one value (per tensor), got shape "
                             f"{tuple(tensor.shape)}")
        value = float(tensor.float().item())
        if not value > 0:
            raise ValueError(f"{name}={value} must be > 0")
        for attr in SUFFIXES[suffix]:
            found[f"{module}.{attr}"] = value


def apply_kv_scales(model: nn.Module, found: dict[str, float]) -> None:
    """Set each scale on the attention implementation under the checkpoint's module
    (``model.layers.3.self_attn`` -> ``layers.3.self_attn.attn.impl``)."""
    if not found:
        return
    impls = {name: module.impl for name, module in model.named_modules() if hasattr(module, "impl")}
    applied = 0
    for key, value in found.items():
        module, _, attr = key.rpartition(".")
        module = module.removeprefix("model.")
        impl = impls.get(f"{module}.attn") or impls.get(module)
        if impl is not None:  # None: a layer of another pipeline stage
            setattr(impl, attr, value)
            applied += 1
    if applied == 0:
        raise ValueError(f"the checkpoint's K/V cache scales ({next(iter(found))!r}, ...) match no "
                         f"attention layer of this model")
    logger.info("K/V cache scales from the checkpoint: %d of %d set", applied, len(found))
