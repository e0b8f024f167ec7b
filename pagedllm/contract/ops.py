"""The op table's spec: the model ops a backend may replace, with the signature each must keep.

The engine builds one table per worker with the torch references (pagedllm/reference/ops.py,
written to reproduce Hugging Face transformers' float32 arithmetic) and hands it to
``Backend.register_ops``, which replaces entries with ``table.register(name, fn)``. The
conformance suite compares every replacement with its reference. Shapes: T tokens, H hidden,
I intermediate, E experts, D head size.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class OpTable(Protocol):
    """What ``Backend.register_ops`` receives. Each op is an attribute holding a function with
    the signature below; ``OP_NAMES`` lists them in this order."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new residual); with ``residual``, normalizes ``x + residual``."""

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's (1 + w) RMSNorm, scale applied in float32: (normed, new residual)."""

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary of x [T, heads, D]; cos/sin [T, D]."""

    def fused_moe(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
        """Top-k routed SiLU-gated experts: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
        gating_output [T, E] -> [T, H]."""

    def fused_moe_prepare(self, experts: torch.nn.Module) -> None:
        """Once per MoE block's experts after loading (e.g. to pre-pack their weights)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]."""

    def linear(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        """x [T, in] @ layer.weight [out, in]^T (+ layer.bias)."""

    def linear_prepare(self, layer: torch.nn.Module) -> None:
        """Once per linear layer after its weights are loaded (e.g. to pre-pack them).
        ``layer.ctx.few_rows`` marks a model that runs a handful of rows per call (a
        speculative proposer): a backend may lay out a copy for that (cpu: few_rows.py)."""

    def greedy_logprobs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, vocab] -> (argmax [rows] int64, its logprob [rows] float32)."""

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: -inf where the packed ``bitmask`` [rows, ceil(vocab / 32)] int32 has a 0
        bit (bit t % 32 of word t // 32 is token t)."""

    def quant_linear(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        """x [T, in] -> [T, out] with a quantized layer (contract/quantization.py's layout)."""

    def quant_linear_prepare(self, layer: torch.nn.Module) -> None:
        """Once per quantized linear after loading (a backend re-packs its weights here)."""

    def rejection_sample(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                         num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         is_greedy: torch.Tensor, uniform: torch.Tensor,
                         noise: torch.Tensor) -> torch.Tensor:
        """Speculative decoding's verification (plugin API 2.1): target_logits [B, K + 1, V]
        float32 (row b's distribution at each verified position), draft_token_ids [B, K],
        num_draft_tokens [B] int64, draft_probs [B, K, V] or None (deterministic drafts),
        is_greedy [B] bool, and the caller's draws uniform [B, K] in [0, 1) and noise [B, V]
        Exp(1) -> output_token_ids [B, K + 1] int64: the accepted drafts, one recovered or
        bonus token, then -1. Random rows accept with probability min(1, p / q) and recover
        from norm(max(0, p - q)); greedy rows emit the argmax run. Randomness comes only from
        the draws (reference/rejection.py)."""

    def lora_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, mapping: Any) -> torch.Tensor:
        """LoRA's first product (plugin API 2.2; capabilities.lora): x [T, in], lora_a [S, N, in]
        (S adapter slots) and ``mapping`` (contract/lora.py ``LoRAMapping``: each token's slot,
        -1 none) -> [T, N] in lora_a's dtype, x[t] @ lora_a[slot_t]^T, zeros without a slot."""

    def lora_expand(self, y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor,
                    scales: torch.Tensor, mapping: Any, slice_rows: Any) -> None:
        """LoRA's second product, in place (plugin API 2.2): for each stacked slice i (output
        rows [slice_rows[i], slice_rows[i + 1])) y[t, rows] += (h[t, i*R:(i+1)*R] @
        lora_b[slot_t, rows]^T) * scales[slot_t, i], rounded to y's dtype; y [T, out], h [T,
        n * R], lora_b [S, out, R], scales [S, n] float32; tokens without a slot unchanged
        (reference/lora.py)."""

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        """Replace op ``name`` (one of OP_NAMES) with ``fn``; ValueError for another name."""


# the ops, in the order OpTable declares them
OP_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(OpTable).items()
    if callable(value) and not name.startswith("_") and name != "register")


def check_op_name(name: str) -> None:
    """ValueError naming ``name`` and the known ops unless it is one of OP_NAMES."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OP_NAMES)}")
