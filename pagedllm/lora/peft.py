"""Reading a PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors (or .bin).

PEFT saves one (A, B) pair per targeted module of the base model, keyed
``base_model.model.<module path>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]);
the module's output gains ``B (A x) * scaling`` with ``scaling = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``), ``r`` and ``lora_alpha`` per module where ``rank_pattern`` /
``alpha_pattern`` match its path. What this engine cannot run exactly (DoRA, LoRA biases,
``modules_to_save``, embedding adapters, ...) is refused, naming the field.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")

# adapter_config.json fields that change the computation in ways not run here, with the value
# that means "off" (a missing field is off too)
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
    "alora_invocation_tokens": (None, []),
    "use_bdlora": (None, False),
}


class LoRAAdapterError(ValueError):
    """An adapter this engine cannot load; the message names the field or file."""


@dataclass
class ModuleLoRA:
    """One targeted module of the base model (its path as in the HF model, e.g.
    ``model.layers.0.self_attn.q_proj``)."""

    name: str
    rank: int
    scaling: float
    a_shape: tuple[int, ...]  # [r, in]
    b_shape: tuple[int, ...]  # [out, r]
    lora_a: torch.Tensor | None = None  # loaded tensors (CPU), None when only shapes were read
    lora_b: torch.Tensor | None = None


@dataclass
class PEFTAdapter:
    path: str
    config: dict[str, Any]
    rank: int  # the largest module rank
    fan_in_fan_out: bool  # the base stores these weights [in, out] (GPT-2's Conv1D)
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: str) -> dict[str, Any]:
    if not isinstance(path, str) or not path:
        raise LoRAAdapterError(f"lora_path={path!r} is invalid: a local PEFT adapter folder "
                               f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS[0]})")
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"lora_path={path!r} is not a folder: a PEFT adapter is a folder "
                               f"with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS[0]}")
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"lora_path={path!r} has no {ADAPTER_CONFIG}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{config_path}: peft_type={config.get('peft_type')!r} is not "
                               "supported; only LORA adapters")
    for name, off in _UNSUPPORTED_FIELDS.items():
        value = config.get(name)
        if value not in off:
            raise LoRAAdapterError(f"{config_path}: {name}={value!r} is not supported (allowed: "
                                   f"{' or '.join(repr(v) for v in off)})")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRAAdapterError(f"{config_path}: {name}={value!r} is invalid: must be a "
                                   "number > 0")
    return config


def _weights_file(path: str) -> str:
    for name in ADAPTER_WEIGHTS:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise LoRAAdapterError(f"lora_path={path!r} has no {ADAPTER_WEIGHTS[0]} (or "
                           f"{ADAPTER_WEIGHTS[1]})")


def _read_tensors(file: str, load: bool) -> dict[str, tuple[tuple[int, ...], torch.Tensor | None]]:
    """name -> (shape, tensor or None); safetensors headers give shapes without reading data."""
    out: dict[str, tuple[tuple[int, ...], torch.Tensor | None]] = {}
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if load:
                        t = f.get_tensor(name)
                        out[name] = (tuple(t.shape), t)
                    else:
                        out[name] = (tuple(f.get_slice(name).get_shape()), None)
        except Exception as exc:  # a truncated or foreign file: safetensors' own error types
            raise LoRAAdapterError(f"{file}: not a readable safetensors file ({exc})") from None
        return out
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LoRAAdapterError(f"{file}: not a readable torch file ({exc})") from None
    return {k: (tuple(v.shape), v if load else None) for k, v in state.items()}


def read_adapter(path: str, max_lora_rank: int, load: bool = True) -> PEFTAdapter:
    """The adapter at ``path`` with each module's rank, scaling and (``load``) its tensors.

    LoRAAdapterError (a ValueError) naming the file, the field or the tensor when the folder
    lacks a file, holds something this engine does not run, or a module's rank exceeds
    ``max_lora_rank``. Whether the modules fit the base model is routing.py's check."""
    config = read_config(path)
    file = _weights_file(path)
    tensors = _read_tensors(file, load)
    pairs: dict[str, dict[str, tuple[tuple[int, ...], torch.Tensor | None]]] = {}
    embedding = next((k for k in tensors if "lora_embedding_" in k), None)
    if embedding is not None:
        raise LoRAAdapterError(f"{file}: {embedding}: adapters on embeddings are not supported "
                               "(target_modules must name linear layers)")
    for key, value in tensors.items():
        if ".base_layer." in key:  # PEFT saves the base weights of embedding / LM-head targets
            raise LoRAAdapterError(f"{file}: {key}: the adapter carries the base model's weights "
                                   "of an embedding or LM-head target; LoRA on embeddings or the "
                                   "LM head is not supported (target_modules must name the "
                                   "attention and MLP linears)")
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"{file}: tensor {key!r} is not a LoRA A/B weight "
                                   "(expected '<module>.lora_A.weight' / '.lora_B.weight'; "
                                   "modules_to_save and biases are not supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    if not pairs:
        raise LoRAAdapterError(f"{file}: holds no LoRA weights")
    use_rslora = bool(config.get("use_rslora", False))
    adapter = PEFTAdapter(path=path, config=config, rank=0,
                          fan_in_fan_out=bool(config.get("fan_in_fan_out", False)))
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAAdapterError(f"{file}: module {module!r} has no {missing} weight")
        (a_shape, a), (b_shape, b) = ab["A"], ab["B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise LoRAAdapterError(f"{file}: module {module!r}: lora_A {list(a_shape)} and "
                                   f"lora_B {list(b_shape)} are not [r, in] and [out, r]")
        rank = a_shape[0]
        want = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        if rank != want:
            raise LoRAAdapterError(f"{file}: module {module!r} has rank {rank} but "
                                   f"adapter_config.json says r={want}")
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"{path}: r={rank} (module {module!r}) exceeds "
                                   f"max_lora_rank={max_lora_rank}; raise max_lora_rank to at "
                                   f"least {rank}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        adapter.modules[module] = ModuleLoRA(module, rank, float(scaling), a_shape, b_shape, a, b)
        adapter.rank = max(adapter.rank, rank)
    return adapter
