"""Quantized checkpoints: one module per format turns its tensors into the canonical layout of
base.py; the op table's ``quant_linear`` multiplies with it (pagedllm/reference/quant.py).

Which method a checkpoint uses, and the names a backend declares, are the contract's
(pagedllm/contract/quantization.py); this package maps each name to its config class.
"""
from __future__ import annotations

import importlib
from typing import Any

from pagedllm.contract.quantization import (QUANTIZATION_METHOD_NAMES, check_backend_support,
                                            checkpoint_quantization, resolve_method)
from pagedllm.models.layers.quantization.base import QuantizationConfig

# method -> "module:Class"; the names (vLLM's) are the contract's QUANTIZATION_METHOD_NAMES
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


def get_quantization_config(hf_config: Any, requested: str | None) -> QuantizationConfig | None:
    """The parsed config of the method the model runs with, or None (full precision)."""
    method = resolve_method(hf_config, requested)
    if method is None:
        return None
    _, cfg = checkpoint_quantization(hf_config)
    return _config_class(method).from_config(cfg)


__all__ = ["QUANTIZATION_METHODS", "QUANTIZATION_METHOD_NAMES", "QuantizationConfig",
           "check_backend_support", "checkpoint_quantization", "get_quantization_config",
           "resolve_method"]
