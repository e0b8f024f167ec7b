"""The one-token decode step of a Llama-family model in one kernel launch, for the batch-1 decode
graphs (csrc/decode_step_kernel.cu: why and how).

Opt-in: ``PAGEDLLM_DECODE_STEP=1``. Measured on an H200 it is still slower than the layer-by-layer
kernels it replaces (168 vs 217 output tok/s at batch 1 on the Llama-3-8B shape; benchmarks/
RESULTS.md), so the batch-1 graphs run those by default. When enabled it is used if every condition
of ``unsupported_reason`` holds: an sm_90+ CUDA device (the weights stream through bulk copies), a
float16/bfloat16 LlamaForCausalLM family model (Llama, Mistral, Qwen2) on one GPU with the csrc/
attention, head size 128, no o_proj / MLP bias, and the kernel's shape limits.
``PAGEDLLM_DECODE_STEP_SLOTS`` sets the weight stages in flight per SM (2-6, default 5).

Its residual adds, norms, rotary, SiLU and GEMVs are bit-identical to the separate kernels; its
attention sums in another order, so logits agree with the layer-by-layer path to float32 rounding of
the attention, not bit for bit.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch
from torch import nn

HEAD_SIZE = 128
MAX_GQA = 8
MAX_HIDDEN = 8192
MAX_K = 16384


def enabled() -> bool:
    return os.environ.get("PAGEDLLM_DECODE_STEP", "0").strip() == "1"


def ring_slots() -> int:
    raw = os.environ.get("PAGEDLLM_DECODE_STEP_SLOTS", "5").strip()
    if not raw.isdigit() or not 2 <= int(raw) <= 6:
        raise ValueError(f"PAGEDLLM_DECODE_STEP_SLOTS={raw!r}: must be an integer in [2, 6]")
    return int(raw)


def unsupported_reason(model: nn.Module, kernels: ModuleType) -> str | None:
    """Why the one-launch step can not run ``model``, or None when it can."""
    from pagedllm.backends.cuda.attention import CudaPagedAttention
    from pagedllm.models.llama import LlamaForCausalLM

    if not hasattr(kernels, "DecodeStep"):
        return "the kernel module has no DecodeStep"
    if getattr(kernels, "kernel_arch", lambda: 0)() < 900:
        return "needs sm_90+ CUDA kernels (bulk copies)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    cfg, ctx = model.config, model.ctx
    if ctx.tp.size != 1:
        return "tensor parallelism"
    if ctx.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {ctx.dtype} (float16 / bfloat16 only)"
    attn = model.layers[0].self_attn
    if not isinstance(attn.attn.impl, CudaPagedAttention):
        return f"attention {type(attn.attn.impl).__name__} (its cache layout is not the kernels')"
    heads, kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
    head_size = attn.attn.impl.head_size
    inter = cfg.intermediate_size
    if head_size != HEAD_SIZE:
        return f"head size {head_size} (128 only)"
    if heads % kv_heads or heads // kv_heads > MAX_GQA:
        return f"{heads} query heads over {kv_heads} kv heads (at most {MAX_GQA} per kv head)"
    if cfg.hidden_size % 8 or cfg.hidden_size > MAX_HIDDEN:
        return f"hidden size {cfg.hidden_size} (a multiple of 8 up to {MAX_HIDDEN})"
    if inter % 8 or inter > MAX_K or heads * head_size > MAX_K:
        return f"intermediate size {inter} / q size {heads * head_size} (multiples of 8 up to {MAX_K})"
    for layer in model.layers:
        if layer.self_attn.attn.impl.sliding_window is not None:
            return "a sliding window (the step's attention has none)"
        if layer.self_attn.o_proj.out_bias is not None or layer.mlp.gate_up_proj.bias is not None \
                or layer.mlp.down_proj.out_bias is not None:
            return "a bias on o_proj or the MLP"
        if layer.input_layernorm.eps != model.norm.eps or \
                layer.post_attention_layernorm.eps != model.norm.eps:
            return "rms_norm epsilons differ between layers"
    return None


class DecodeStep:
    """``run`` writes the float32 logits of one token of one sequence; the inputs are the decode
    graphs' static buffers (one element each, and the sequence's block-table row)."""

    def __init__(self, model: Any, kernels: ModuleType, kv_caches: list[torch.Tensor],
                 max_model_len: int) -> None:
        layers = model.layers
        attn = layers[0].self_attn
        biases = [layer.self_attn.qkv_proj.bias for layer in layers]
        self.step = kernels.DecodeStep(
            model.embed_tokens.weight, model.norm.weight, model.lm_head.weight,
            model.rotary.cos, model.rotary.sin,
            [layer.self_attn.qkv_proj.weight for layer in layers],
            [] if biases[0] is None else biases,
            [layer.self_attn.o_proj.weight for layer in layers],
            [layer.mlp.gate_up_proj.weight for layer in layers],
            [layer.mlp.down_proj.weight for layer in layers],
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            list(kv_caches), attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads,
            model.norm.eps, attn.attn.impl.scale, max_model_len, ring_slots())

    def run(self, token: torch.Tensor, position: torch.Tensor, slot: torch.Tensor,
            seq_len: torch.Tensor, block_table: torch.Tensor, logits: torch.Tensor) -> None:
        self.step.run(token, position, slot, seq_len, block_table, logits)


def build(model: nn.Module, kernels: ModuleType, kv_caches: list[torch.Tensor],
          max_model_len: int) -> tuple[DecodeStep | None, str | None]:
    """(the step, None) when it can run the model, else (None, the reason)."""
    if not enabled():
        return None, "off (PAGEDLLM_DECODE_STEP=1 turns it on)"
    reason = unsupported_reason(model, kernels)
    if reason is not None:
        return None, reason
    return DecodeStep(model, kernels, kv_caches, max_model_len), None
