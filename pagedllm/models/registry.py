"""The model registry: Hugging Face ``architectures`` name -> model class + the attention features
its checkpoints may need.

Before loading, the engine's configuration check (engine/config_validation.py) asks
``missing_features``: a model whose config turns on an attention feature
(``Capabilities.attention_features``) that the chosen backend lacks is refused with the feature
named, never run with wrong results.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# attention feature -> does this HF config turn it on? (the values Capabilities.attention_features
# may hold; a model entry lists the ones its family can use)
FEATURE_PROBES: dict[str, Callable[[Any], bool]] = {
    "sliding_window": lambda c: bool(getattr(c, "sliding_window", None))
    and getattr(c, "use_sliding_window", True) is not False,
    "logits_soft_cap": lambda c: bool(getattr(c, "attn_logit_softcapping", None)),
}


@dataclass(frozen=True)
class ModelEntry:
    """One architecture: where its class lives and which attention features it can need."""

    target: str  # "module:Class", imported only when the model is loaded
    features: tuple[str, ...] = ()  # keys of FEATURE_PROBES
    # overrides FEATURE_PROBES for this family: config -> the features that config needs
    needs: Callable[[Any], tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURE_PROBES]
        if unknown:
            raise ValueError(f"unknown attention feature(s) {unknown}; known: "
                             f"{', '.join(FEATURE_PROBES)}")

    def features_needed(self, hf_config: Any) -> tuple[str, ...]:
        if self.needs is not None:
            return tuple(self.needs(hf_config))
        return tuple(f for f in self.features if FEATURE_PROBES[f](hf_config))


# HF architecture name -> entry. New families: one line here (docs/adding_a_model.md).
MODEL_REGISTRY: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("pagedllm.models.llama:LlamaForCausalLM"),
    "MistralForCausalLM": ModelEntry("pagedllm.models.llama:MistralForCausalLM",
                                     ("sliding_window",)),
    "Qwen2ForCausalLM": ModelEntry("pagedllm.models.llama:Qwen2ForCausalLM", ("sliding_window",)),
    "OPTForCausalLM": ModelEntry("pagedllm.models.opt:OPTForCausalLM"),
    "Gemma2ForCausalLM": ModelEntry("pagedllm.models.gemma2:Gemma2ForCausalLM",
                                    ("sliding_window", "logits_soft_cap")),
    "Gemma3ForCausalLM": ModelEntry("pagedllm.models.gemma3:Gemma3ForCausalLM",
                                    ("sliding_window", "logits_soft_cap")),
    "Qwen3ForCausalLM": ModelEntry("pagedllm.models.qwen3:Qwen3ForCausalLM", ("sliding_window",)),
    "Phi3ForCausalLM": ModelEntry("pagedllm.models.phi3:Phi3ForCausalLM", ("sliding_window",)),
    "GPT2LMHeadModel": ModelEntry("pagedllm.models.gpt2:GPT2LMHeadModel"),
    "GPTNeoXForCausalLM": ModelEntry("pagedllm.models.gpt_neox:GPTNeoXForCausalLM"),
    "MixtralForCausalLM": ModelEntry("pagedllm.models.mixtral:MixtralForCausalLM",
                                     ("sliding_window",)),
    "Qwen3MoeForCausalLM": ModelEntry("pagedllm.models.qwen3_moe:Qwen3MoeForCausalLM",
                                      ("sliding_window",)),
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(hf_config: Any) -> str:
    """The first of the config's ``architectures`` that the registry knows."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch
    raise ValueError(f"model architecture {archs or '(none in config.json)'} is not supported; "
                     f"supported architectures: {', '.join(supported_architectures())}")


def model_class(arch: str) -> type[nn.Module]:
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"architecture {arch!r} is not supported; supported architectures: "
                         f"{', '.join(supported_architectures())}")
    module, _, name = MODEL_REGISTRY[arch].target.partition(":")
    return getattr(importlib.import_module(module), name)


def missing_features(arch: str, hf_config: Any, backend_features: Iterable[str]) -> list[str]:
    have = set(backend_features)
    return [f for f in MODEL_REGISTRY[arch].features_needed(hf_config) if f not in have]
