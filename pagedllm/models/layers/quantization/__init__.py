"""Quantized checkpoints: one module per format turns its tensors into the canonical layout of
base.py; the ops registry's ``quant_linear`` multiplies with it (reference.py).

The method comes from config.json's ``quantization_config.quant_method``; the ``quantization``
engine argument forces one (it must then agree with the checkpoint's, except "fp8", which
quantizes a float checkpoint at load time).
"""
from __future__ import annotations

import importlib
from typing import Any

from pagedllm.models.layers.quantization.base import QuantizationConfig

# method -> "module:Class"; the names are vLLM's
QUANTIZATION_METHODS: dict[str, str] = {
    "awq": "pagedllm.models.layers.quantization.awq:AWQConfig",
    "gptq": "pagedllm.models.layers.quantization.gptq:GPTQConfig",
    "compressed-tensors":
        "pagedllm.models.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "pagedllm.models.layers.quantization.fp8:Fp8Config",
}


def _config_class(method: str) -> type[QuantizationConfig]:
    module, _, name = QUANTIZATION_METHODS[method].partition(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_quantization(hf_config: Any) -> tuple[str | None, dict[str, Any]]:
    """(quant_method, quantization_config dict) of a checkpoint; (None, {}) when unquantized."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None, {}
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    method = cfg.get("quant_method")
    if method is None:
        raise ValueError("config.json's quantization_config has no quant_method; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    method = str(method).lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported; "
                         f"supported: {', '.join(QUANTIZATION_METHODS)}")
    return method, cfg


def resolve_method(hf_config: Any, requested: str | None) -> str | None:
    """The method a model runs with: the checkpoint's, or ``requested`` where it agrees."""
    method, _ = checkpoint_quantization(hf_config)
    if requested is None:
        return method
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is invalid; allowed values are "
                         f"{', '.join(QUANTIZATION_METHODS)} or None")
    if method is not None and method != requested:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's "
                         f"quantization_config.quant_method={method!r}; leave quantization unset "
                         f"to use the checkpoint's method")
    return requested


def get_quantization_config(hf_config: Any, requested: str | None) -> QuantizationConfig | None:
    """The parsed config of the method the model runs with, or None (full precision)."""
    method = resolve_method(hf_config, requested)
    if method is None:
        return None
    _, cfg = checkpoint_quantization(hf_config)
    return _config_class(method).from_config(cfg)


def check_backend_support(method: str | None, backend_name: str,
                          supported: tuple[str, ...]) -> None:
    """Refuse a method the backend does not declare, naming the backends that do."""
    if method is None or method in supported:
        return
    from pagedllm.backends.registry import discover

    others = [name for name, info in discover().items()
              if info.cls is not None and method in info.cls.capabilities.quantizations]
    raise ValueError(f"quantization={method!r} is not supported by the {backend_name} backend; "
                     f"backends that support it: {', '.join(others) or 'none'}")


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "check_backend_support",
           "checkpoint_quantization", "get_quantization_config", "resolve_method"]
