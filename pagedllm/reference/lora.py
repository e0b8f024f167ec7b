"""LoRA's shrink and expand (the op table's ``lora_shrink`` / ``lora_expand``, contract/ops.py):
the torch reference, written as PEFT computes one adapter (``result + lora_B(lora_A(x)) *
scaling``) for the tokens of each slot. Backends register kernels (cpu: backends/cpu/lora_ops.py,
cuda: backends/cuda/triton_lora.py); the conformance suite compares them with these
(pagedllm/testing/test_lora.py).

Layout (one linear of the model; S = max_loras slots, R = max_lora_rank, n = the matrices the
linear stacks, e.g. 3 for q/k/v): ``lora_a`` [S, n * R, in] holds each slice's A [r, in] in rows
[i * R, i * R + r) (zeros beyond r), ``lora_b`` [S, out, R] each slice's B [rows, r] in its
output rows (zeros beyond r), ``scales`` [S, n] float32 the slices' scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA). Zero padding adds exact zeros, so a rank-r adapter in a rank-R slot
computes what it computes alone.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.contract.lora import LoRAMapping


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """x [T, in], lora_a [S, N, in] -> [T, N] in lora_a's dtype: row t is x[t] @ lora_a[s]^T
    for the token's slot s, zeros for tokens without an adapter."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=lora_a.dtype, device=x.device)
    slots = mapping.token_slots.to(torch.int64)
    for s in range(lora_a.shape[0]):
        rows = slots == s
        if bool(rows.any()):
            out[rows] = x[rows].to(lora_a.dtype) @ lora_a[s].t()
    return out


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                mapping: LoRAMapping, slice_rows: Sequence[int]) -> None:
    """In place: y [T, out] += for each slice i (output rows [slice_rows[i], slice_rows[i + 1])):
    (h[t, i*R:(i+1)*R] @ lora_b[s, rows]^T) * scales[s, i], s the token's slot (tokens without
    an adapter unchanged). h [T, n * R] (lora_shrink's output), lora_b [S, out, R], scales
    [S, n] float32; the product is rounded to y's dtype before the add, as PEFT adds in the
    model's dtype."""
    rank = lora_b.shape[2]
    slots = mapping.token_slots.to(torch.int64)
    for s in range(lora_b.shape[0]):
        rows = slots == s
        if not bool(rows.any()):
            continue
        for i in range(len(slice_rows) - 1):
            lo, hi = slice_rows[i], slice_rows[i + 1]
            delta = h[rows, i * rank:(i + 1) * rank] @ lora_b[s, lo:hi].t()
            y[rows, lo:hi] += (delta * scales[s, i]).to(y.dtype)
