"""Builds an engine-native model from a local Hugging Face folder (or random weights)."""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.models.layers.embedding import ParallelLMHead
from pagedllm.models.layers.linear import LayerContext, LinearBase
from pagedllm.models.layers.moe import FusedExperts
from pagedllm.models.layers.quantization import get_quantization_config
from pagedllm.models.layers.quantization.dummy import init_dummy_quantized
from pagedllm.models.layers.quantization.kv_scales import apply_kv_scales, split_kv_scales
from pagedllm.models.registry import MODEL_REGISTRY, model_class, resolve_architecture  # noqa: F401

logger = logging.getLogger(__name__)

def iterate_checkpoint(path: str, load_format: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) pairs from safetensors files, or from .bin files with weights_only=True."""
    st_files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    bin_files = sorted(glob.glob(os.path.join(path, "*.bin")))
    if load_format in ("auto", "safetensors") and st_files:
        from safetensors import safe_open

        for file in st_files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    if load_format in ("auto", "pt") and bin_files:
        for file in bin_files:
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()
            del state
        return
    raise FileNotFoundError(f"no {'safetensors or .bin' if load_format == 'auto' else load_format} "
                            f"weights found in {path!r}")


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights (uniform in [-1e-3, 1e-3], norms at 1) for benchmarks without a checkpoint."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            if param.dtype.itemsize == 1 or not param.is_floating_point():
                continue  # quantized codes and group indices: init_dummy_quantized
            gen = gens.setdefault(param.device,
                                  torch.Generator(device=param.device).manual_seed(seed))
            param.uniform_(-1e-3, 1e-3, generator=gen)


def prepare_linears(model: nn.Module, ctx: LayerContext) -> None:
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant is not None:
            ctx.quant.process_after_loading(module)
            ctx.ops.quant_linear_prepare(module)
        elif isinstance(module, (LinearBase, ParallelLMHead)):
            ctx.ops.linear_prepare(module)
        elif isinstance(module, FusedExperts):
            ctx.ops.fused_moe_prepare(module)


def load_model(model_config: ModelConfig, ctx: LayerContext) -> nn.Module:
    arch = resolve_architecture(model_config.hf_config)
    cls = model_class(arch)
    ctx.quant = get_quantization_config(model_config.hf_config,
                                        getattr(model_config, "quantization", None))
    if ctx.quant is not None:
        logger.info("quantized linears: %s", ctx.quant.describe())
    model = cls(model_config.hf_config, ctx, max_positions=model_config.max_model_len)
    if model_config.load_format == "dummy":
        _init_dummy(model, model_config.seed)
        if ctx.quant is not None:
            init_dummy_quantized(model, model_config.seed)
    else:
        kv_scales: dict[str, float] = {}
        weights = split_kv_scales(iterate_checkpoint(model_config.model, model_config.load_format),
                                  kv_scales)
        model.load_weights(weights if ctx.quant is None else ctx.quant.convert(weights))
        apply_kv_scales(model, kv_scales)
    prepare_linears(model, ctx)
    return model.eval()
