"""``fused_moe`` on Triton, grouped by expert (the cuda and rocm backends register it).

The (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
BLOCK_M, so every row block of the grouped matmul belongs to one expert (``block_expert``); pad
rows hold the invalid pair id ``num_pairs`` and are masked. Two launches of one kernel:
  1. inter [pairs, 2I] = hidden[pair // topk] @ w13[e]^T
  2. y [pairs, H] = (silu(gate) * up)[pair] @ w2[e]^T * routing weight[pair]
then out[t] = sum over its topk slots of y. Pair p = token * topk + slot.
Accumulation is float32 (IEEE products for float32 inputs, no TF32). Runs in Triton's
interpreter on the CPU (TRITON_INTERPRET=1), which is how tests/backends/test_triton_moe.py
checks it against the torch reference without a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.reference.moe import check_shapes, select_experts

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _grouped_matmul(a_ptr, b_ptr, c_ptr, pair_ptr, block_expert_ptr, weight_ptr,
                    num_pairs, N, K, a_div,
                    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    a_rows = tl.where(valid, pairs // a_div, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_k[:, None] * stride_bk
                    + offs_n[None, :] * stride_bn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + tl.where(valid, pairs, 0)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids [padded] int32, the expert of each BLOCK_M block [padded / block_m] int32):
    pairs sorted by expert (stable), each expert's run padded with ``ids.numel()``."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    sorted_e = flat[order]
    pos = padded_starts[sorted_e] + torch.arange(num_pairs, device=ids.device) - starts[sorted_e]
    pair_ids = torch.full((int(padded.sum()),), num_pairs, dtype=torch.int32, device=ids.device)
    pair_ids[pos] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device,
                                                        dtype=torch.int32), padded // block_m)
    return pair_ids, block_expert


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_ids: torch.Tensor,
            block_expert: torch.Tensor, weights: torch.Tensor | None, a_div: int) -> None:
    """out[pair] = a[pair // a_div] @ w[expert]^T (* weights[pair]); w [E, N, K]."""
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_matmul[grid](
        a, w, out, pair_ids, block_expert, weights if weights is not None else out,
        out.shape[0], n, k, a_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              gating_output: torch.Tensor, topk: int, renormalize: bool) -> torch.Tensor:
    """The ops-registry ``fused_moe`` (moe_ops.py's signature and routing)."""
    check_shapes(hidden, w13, w2, gating_output, topk)
    t, h = hidden.shape
    if t == 0:
        return torch.zeros_like(hidden)
    inter = w2.shape[-1]
    weights, ids = select_experts(gating_output, topk, renormalize)
    pair_ids, block_expert = align_by_expert(ids, w13.shape[0])
    num_pairs = t * topk
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden.contiguous(), w13, gate_up, pair_ids, block_expert, None, topk)
    act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()  # [pairs, I]
    y = torch.empty(num_pairs, h, dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, y, pair_ids, block_expert, weights.reshape(-1).contiguous(), 1)
    return y.view(t, topk, h).sum(dim=1)
