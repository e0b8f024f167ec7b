"""Builds a worker's device proposer (draft model or EAGLE head) from a SpeculativeConfig whose
method and model were resolved when the engine started (``resolve_method``)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from torch import nn

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.models.layers.embedding import VocabParallelEmbedding
from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.pipeline import PPMissingLayer
from pagedllm.models.loader import iterate_checkpoint, load_model, prepare_linears
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.eagle import (Eagle1Head, Eagle3Head, eagle3_aux_layer_ids, eagle_version,
                                        is_eagle_checkpoint)
from pagedllm.spec_decode.proposer import DeviceProposer, DraftModelProposer, EagleProposer


def load_config(path: str) -> Any:
    """The checkpoint's transformers config; EAGLE folders whose model_type transformers does
    not know (vLLM's "eagle") load as a LlamaConfig of their fields."""
    from transformers import AutoConfig, LlamaConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config.model={path!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError):
        with open(os.path.join(path, "config.json")) as f:
            fields = json.load(f)
        fields.pop("model_type", None)
        return LlamaConfig(**fields)


def resolve_method(spec: SpeculativeConfig) -> str:
    """The method of a config that named only a model: eagle (or eagle3) for an EAGLE head's
    folder, else draft_model."""
    if spec.method is not None:
        return spec.method
    assert spec.model is not None
    if is_eagle_checkpoint(spec.model):
        hf = load_config(spec.model)
        return "eagle3" if eagle_version(spec.model, hf, _tensor_names(spec.model)) == 3 else "eagle"
    return "draft_model"


def _tensor_names(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return []
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def _read_tensor(path: str, names: tuple[str, ...], load_format: str = "auto"
                 ) -> torch.Tensor | None:
    """The first of ``names`` found in the checkpoint at ``path`` (safetensors: only that
    tensor is read), or None."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files and load_format in ("auto", "safetensors"):
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                found = [n for n in names if n in f.keys()]
                if found:
                    return f.get_tensor(found[0])
        return None
    return next((t for n, t in iterate_checkpoint(path, load_format) if n in names), None)


def check_draft_config(spec: SpeculativeConfig, config: EngineConfig) -> Any:
    """The draft's (or head's) config, checked against the target: the same vocabulary (a draft
    model must share the tokenizer); returns it."""
    assert spec.model is not None
    hf = load_config(spec.model)
    target_vocab = config.model.get_vocab_size()
    vocab = int(getattr(hf, "vocab_size", 0) or 0)
    if vocab != target_vocab:
        raise ValueError(f"speculative_config.model={spec.model!r} has vocab_size={vocab}, the "
                         f"target model {target_vocab}: a draft must share the target's "
                         "tokenizer")
    return hf


def build_proposer(spec: SpeculativeConfig, config: EngineConfig, target: nn.Module,
                   ctx: LayerContext) -> DeviceProposer:
    """Load the draft model or EAGLE head onto ``ctx``'s device (float weights in the target's
    dtype, one unsharded copy; built ``few_rows``: its draft passes run a row per sequence)."""
    assert spec.model is not None and spec.method in ("draft_model", "eagle", "eagle3")
    hf = check_draft_config(spec, config)
    own = dataclasses.replace(ctx, quant=None, few_rows=True)
    block_size = config.cache.block_size
    max_len = config.model.max_model_len
    with torch.inference_mode():
        if spec.method == "draft_model":
            mc = ModelConfig(model=spec.model, tokenizer=spec.model, dtype=config.model.dtype,
                             max_model_len=max_len, seed=config.model.seed,
                             load_format="dummy" if config.model.load_format == "dummy"
                             else "auto", hf_config=hf)
            model = load_model(mc, own)
            return DraftModelProposer(model, hf, own, block_size)
        names = _tensor_names(spec.model)
        version = 3 if spec.method == "eagle3" else eagle_version(spec.model, hf, names)
        if not hasattr(target, "embed_tokens") or not hasattr(target, "layers"):
            raise ValueError(f"speculative_config.method={spec.method!r} needs a Llama-family "
                             f"target (embed_tokens, decoder layers); "
                             f"{type(target).__name__} is not one")
        own_embedding = "embed_tokens.weight" in names or "model.embed_tokens.weight" in names
        if version == 3:
            head: nn.Module = Eagle3Head(hf, own, max_len, int(config.model.hf_config.hidden_size),
                                         own_embedding=own_embedding)
        else:
            fc_bias = "fc.bias" in names or bool(getattr(hf, "eagle_fc_bias", False))
            head = Eagle1Head(hf, own, max_len, fc_bias=fc_bias, own_embedding=own_embedding)
        head.load_weights(iterate_checkpoint(spec.model))
        prepare_linears(head, own)
        if head.embed_tokens is None and isinstance(target.embed_tokens, PPMissingLayer):
            # the last pipeline stage of a target whose LM head is not its embedding
            head.embed_tokens = target_embedding(config, own)
        return EagleProposer(head.eval(), target, own, block_size)


EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


def target_embedding(config: EngineConfig, ctx: LayerContext) -> nn.Module:
    """The target's token embedding, for an EAGLE head on a pipeline stage that does not hold
    it (only the first stage embeds): loaded from the target's checkpoint alone."""
    hf = config.model.hf_config
    embed = VocabParallelEmbedding(config.model.get_vocab_size(), int(hf.hidden_size), ctx)
    if config.model.load_format == "dummy":
        return embed
    path = config.model.model
    tensor = _read_tensor(path, EMBEDDING_NAMES, config.model.load_format)
    if tensor is not None:
        embed.weight_loader(embed.weight, tensor.to(embed.weight.dtype))
        return embed
    raise ValueError(f"speculative_config.method=eagle with pipeline_parallel_size="
                     f"{config.parallel.pipeline_parallel_size} reads the target's embedding on "
                     f"its last stage, but {path!r} has no tensor named "
                     f"{' or '.join(EMBEDDING_NAMES)}")


def aux_layer_ids(spec: SpeculativeConfig, config: EngineConfig) -> tuple[int, ...]:
    """The target layers whose input residual stream the proposer reads: an EAGLE-3 head's
    (eagle3_aux_layer_ids), () for every other method (pipeline stages without the head pass
    these on to the last stage)."""
    if spec.method not in ("eagle", "eagle3") or spec.model is None:
        return ()
    hf = load_config(spec.model)
    version = (3 if spec.method == "eagle3"
               else eagle_version(spec.model, hf, _tensor_names(spec.model)))
    if version != 3:
        return ()
    return eagle3_aux_layer_ids(hf, config.model.get_num_layers())
