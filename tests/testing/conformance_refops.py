"""The reference plugin's own model ops, written as a port writes kernels: rows in tiles of
``ROW_TILE``, the vocabulary in tiles of ``VOCAB_TILE``, experts one by one, each step a small
method so a mutant (conformance_mutants.py) can replace exactly one with a realistic bug. Plain
float32 torch; not the pagedllm references, so the suite compares two implementations.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

REF_OPS = ("rms_norm", "gemma_rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul", "linear",
           "greedy_logprobs", "apply_token_bitmask", "fused_moe")
ROW_TILE = 32  # rows a norm "kernel" handles per launch
VOCAB_TILE = 1024  # logits per argmax tile


class RefOps:
    # --- norms --------------------------------------------------------------------------------
    @classmethod
    def rms_norm(cls, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return cls.norm_rows(x, weight, eps, residual, gemma=False)

    @classmethod
    def gemma_rms_norm(cls, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return cls.norm_rows(x, weight, eps, residual, gemma=True)

    @classmethod
    def norm_rows(cls, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = torch.empty_like(x), torch.empty_like(x)
        for start in range(0, x.shape[0], ROW_TILE):
            rows = slice(start, start + ROW_TILE)
            h = cls.add_residual(x[rows], None if residual is None else residual[rows], start)
            summed[rows] = h
            normed[rows] = cls.normalize(h, weight, eps, gemma)
        return normed, summed

    @staticmethod
    def add_residual(x: torch.Tensor, residual: torch.Tensor | None, start: int) -> torch.Tensor:
        return x if residual is None else x + residual

    @staticmethod
    def normalize(h: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
        hf = h.float()
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        if gemma:
            return (n * (1.0 + weight.float())).to(h.dtype)
        return weight * n.to(h.dtype) if h.dtype != torch.float32 else n * weight

    # --- rotary, activations, linear ---------------------------------------------------------
    @classmethod
    def rotary(cls, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (possibly a strided slice of wider heads); cos/sin [T, D]."""
        x = cls.load_heads(x)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    @staticmethod
    def load_heads(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (F.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)

    @staticmethod
    def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (F.gelu(x[..., :half].float(), approximate="tanh")
                * x[..., half:].float()).to(x.dtype)

    @classmethod
    def linear(cls, x: torch.Tensor, layer: Any) -> torch.Tensor:
        y = x.float() @ layer.weight.float().t()
        return cls.add_bias(y, getattr(layer, "bias", None)).to(x.dtype)

    @staticmethod
    def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return y if bias is None else y + bias.float()

    # --- sampling-side ops --------------------------------------------------------------------
    @classmethod
    def greedy_logprobs(cls, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row the first index of the max, over vocabulary tiles, and its logprob."""
        best_val = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
        best_idx = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        for start in cls.vocab_tiles(logits.shape[1]):
            tile = logits[:, start:start + VOCAB_TILE].float()
            val, idx = tile.max(-1)
            better = val > best_val  # strictly: an earlier tile keeps a tie
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + start, best_idx)
        lse = torch.logsumexp(logits.float(), dim=-1)
        return best_idx, best_val - lse

    @staticmethod
    def vocab_tiles(vocab: int) -> range:
        return range(0, vocab, VOCAB_TILE)

    @classmethod
    def apply_token_bitmask(cls, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        vocab = logits.shape[1]
        for word in range(cls.words(vocab)):
            bits = (bitmask[:, word:word + 1].long() >> torch.arange(32, device=bitmask.device)) & 1
            cols = slice(32 * word, min(vocab, 32 * word + 32))
            width = cols.stop - cols.start
            logits[:, cols].masked_fill_(bits[:, :width] == 0, float("-inf"))

    @staticmethod
    def words(vocab: int) -> int:
        return (vocab + 31) // 32

    # --- MoE ----------------------------------------------------------------------------------
    @classmethod
    def fused_moe(cls, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  router_logits: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
        probs = router_logits.float().softmax(-1)
        weights, experts = probs.topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w13.shape[0]):
            rows, slot = (cls.expert_ids(experts, w13.shape[0]) == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = x[rows].float() @ w13[e].float().t()
            half = h.shape[-1] // 2
            y = (F.silu(h[:, :half]) * h[:, half:]) @ w2[e].float().t()
            out.index_add_(0, rows, y * weights[rows, slot][:, None])
        return out.to(x.dtype)

    @staticmethod
    def expert_ids(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
        return experts
