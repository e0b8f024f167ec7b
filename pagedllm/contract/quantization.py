"""Quantization in the contract: the method names a backend may declare in
``Capabilities.quantizations``, how a checkpoint names its method, and the canonical layout
every backend's ``quant_linear`` op reads (pagedllm/models/layers/quantization/base.py builds it;
pagedllm/reference/quant.py is the reference arithmetic).

The method comes from config.json's ``quantization_config.quant_method``; the ``quantization``
engine argument forces one (it must then agree with the checkpoint's, except "fp8", which
quantizes a float checkpoint at load time).
"""
from __future__ import annotations

from typing import Any

# the methods pagedllm loads (vLLM's names); models/layers/quantization maps each to its config
QUANTIZATION_METHOD_NAMES: tuple[str, ...] = ("awq", "gptq", "compressed-tensors", "fp8")

# what activations go through before the matmul (``layer.quant.act``)
ACT_NONE = "none"
ACT_FP8_PER_TOKEN = "fp8_per_token"  # dynamic e4m3, one scale per token (row)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value


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
                         f"{', '.join(QUANTIZATION_METHOD_NAMES)}")
    method = str(method).lower()
    if method not in QUANTIZATION_METHOD_NAMES:
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported; "
                         f"supported: {', '.join(QUANTIZATION_METHOD_NAMES)}")
    return method, cfg


def resolve_method(hf_config: Any, requested: str | None) -> str | None:
    """The method a model runs with: the checkpoint's, or ``requested`` where it agrees."""
    method, _ = checkpoint_quantization(hf_config)
    if requested is None:
        return method
    if requested not in QUANTIZATION_METHOD_NAMES:
        raise ValueError(f"quantization={requested!r} is invalid; allowed values are "
                         f"{', '.join(QUANTIZATION_METHOD_NAMES)} or None")
    if method is not None and method != requested:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's "
                         f"quantization_config.quant_method={method!r}; leave quantization unset "
                         f"to use the checkpoint's method")
    return requested


def check_backend_support(method: str | None, backend_name: str,
                          supported: tuple[str, ...]) -> None:
    """Refuse a method the backend does not declare, naming the backends that do."""
    if method is None or method in supported:
        return
    from pagedllm.contract.registry import discover

    others = [name for name, info in discover().items()
              if info.cls is not None and method in info.cls.capabilities.quantizations]
    raise ValueError(f"quantization={method!r} is not supported by the {backend_name} backend; "
                     f"backends that support it: {', '.join(others) or 'none'}")
