"""The reference op table: one torch implementation of each op of the spec (contract/ops.py); a
backend registers faster ones in ``Backend.register_ops``.

The references are written to reproduce Hugging Face transformers' float32 arithmetic exactly
(same operation order), since greedy outputs are compared token for token.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.contract.ops import OP_NAMES, check_op_name
from pagedllm.reference.lora import lora_expand, lora_shrink
from pagedllm.reference.moe import fused_moe, fused_moe_prepare
from pagedllm.reference.quant import quant_linear, quant_linear_prepare
from pagedllm.reference.rejection import rejection_sample


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new residual). With ``residual``, normalizes ``x + residual``.

    transformers: ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` with h = x in float32;
    F.rms_norm computes exactly that in one kernel (bit-identical in float32).
    """
    if residual is not None:
        x = x + residual
    residual = x
    size = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, size, weight, eps), residual
    return weight * F.rms_norm(x.float(), size, None, eps).to(x.dtype), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's (1 + w) RMSNorm: returns (normed, new residual); with ``residual``, normalizes
    ``x + residual`` (added in x's dtype). ``weight`` is the checkpoint's w (zeros = identity).

    transformers' GemmaRMSNorm: ``(h * rsqrt(mean(h^2) + eps) * (1 + w.float())).to(dtype)``
    with h = x in float32: the scale is applied in float32 and rounded once, at the end."""
    if residual is not None:
        x = x + residual
    residual = x
    compute = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
    normed = F.rms_norm(x.to(compute), (x.shape[-1],), None, eps) * (1.0 + weight.to(compute))
    return normed.to(x.dtype), residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of x [T, heads, D] (queries and keys together); cos/sin [T, D].

    Same arithmetic as transformers' ``x * cos + rotate_half(x) * sin``.
    """
    half = x.shape[-1] // 2
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> silu(x[:, :I]) * x[:, I:]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's gelu_pytorch_tanh gate)."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (argmax [rows] int64, its logprob [rows] float32): the sampler's
    draw for rows that are plain greedy (worker/sampler.py), one fused op on backends that
    register one."""
    tokens = logits.argmax(dim=-1)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits`` [rows, vocab] float gets -inf wherever ``bitmask`` [rows,
    ceil(vocab / 32)] int32 has a 0 bit (bit t % 32 of word t // 32 is token t; guided decoding's
    packed mask, built on the host by xgrammar)."""
    vocab = logits.shape[1]
    # one int32 mask per bit (bit 31 is the sign bit); AND, not a right shift of signed words,
    # which XLA lowers differently for negative words
    bits = torch.tensor([1 << i for i in range(31)] + [-2**31], dtype=torch.int32,
                        device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) & bits) != 0).flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def linear_prepare(layer: torch.nn.Module) -> None:
    """Called once per linear layer after its weights are loaded (e.g. to pre-pack them)."""


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    return F.linear(x, layer.weight, getattr(layer, "bias", None))


class Ops:
    """A per-engine table of ops (contract/ops.py's ``OpTable``), the references to start with.
    Backends replace entries in ``Backend.register_ops``."""

    NAMES = OP_NAMES

    def __init__(self) -> None:
        self.rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rms_norm
        self.gemma_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gemma_rms_norm
        self.rotary: Callable[..., torch.Tensor] = rotary
        # sparse MoE experts with top-k routing (reference/moe.py)
        self.fused_moe: Callable[..., torch.Tensor] = fused_moe
        # once per MoE block's experts after loading (e.g. pre-packing each expert's weights)
        self.fused_moe_prepare: Callable[[torch.nn.Module], None] = fused_moe_prepare
        self.silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
        self.gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul
        self.linear: Callable[[torch.Tensor, Any], torch.Tensor] = linear
        self.linear_prepare: Callable[[torch.nn.Module], None] = linear_prepare
        self.greedy_logprobs: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = \
            greedy_logprobs
        # quantized linears (reference/quant.py): x [T, in] -> [T, out]; prepare runs
        # once per layer after loading
        self.quant_linear: Callable[[torch.Tensor, Any], torch.Tensor] = quant_linear
        self.quant_linear_prepare: Callable[[torch.nn.Module], None] = quant_linear_prepare
        self.apply_token_bitmask: Callable[[torch.Tensor, torch.Tensor], None] = \
            apply_token_bitmask
        # speculative decoding's verification (reference/rejection.py): target logits, drafts
        # and the caller's random draws -> the tokens each sequence emits
        self.rejection_sample: Callable[..., torch.Tensor] = rejection_sample
        # LoRA's per-token batched shrink and expand (reference/lora.py; punica's layout)
        self.lora_shrink: Callable[..., torch.Tensor] = lora_shrink
        self.lora_expand: Callable[..., None] = lora_expand

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        check_op_name(name)
        setattr(self, name, fn)
