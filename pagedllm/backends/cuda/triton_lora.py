"""LoRA's shrink and expand as Triton kernels (punica's batched GEMV, BGMV): one launch for every
adapter of the batch, each token reading its slot's matrices; a token without an adapter (slot
-1) returns at once. The kernels read only ``mapping.token_slots`` (a device buffer the worker
fills in place each step) and the preallocated slot buffers, so a captured CUDA graph replays
with the step's adapters. Same results as reference/lora.py (float32 accumulation, the product
rounded to the output's dtype before the add). Runs on CPU tensors under TRITON_INTERPRET=1 (how
the tests exercise it without a GPU).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pagedllm.contract.lora import LoRAMapping

BLOCK_N = 32  # output columns per program
BLOCK_K = 64  # reduction chunk
MAX_SLICES = 4  # stacked matrices a linear may have (q/k/v: 3)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, slots_ptr, n, k, sx0, sa0, sa1, so0,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < n
    slot = tl.load(slots_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            in_k = ks < k
            xv = tl.load(x_ptr + t * sx0 + ks, mask=in_k, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * sa0 + cols[:, None] * sa1 + ks[None, :],
                         mask=in_n[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out_ptr + t * so0 + cols, acc.to(out_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, scales_ptr, slots_ptr, rows_ptr, out, rank, sy0, sh0,
                   sb0, sb1, ss0, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = cols < out
        # the stacked slice each output column belongs to: columns at or past a boundary
        piece = tl.zeros([BLOCK_N], dtype=tl.int64)
        for i in tl.static_range(1, NUM_SLICES):
            piece += (cols >= tl.load(rows_ptr + i)).to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            in_r = rs < rank
            m = in_n[:, None] & in_r[None, :]
            hv = tl.load(h_ptr + t * sh0 + piece[:, None] * rank + rs[None, :], mask=m,
                         other=0.0).to(tl.float32)
            bv = tl.load(b_ptr + slot * sb0 + cols[:, None] * sb1 + rs[None, :], mask=m,
                         other=0.0).to(tl.float32)
            acc += tl.sum(hv * bv, axis=1)
        scale = tl.load(scales_ptr + slot * ss0 + piece, mask=in_n, other=0.0)
        # the product rounded to y's dtype, then added in float32 and rounded once more (what
        # a half-precision add computes)
        delta = (acc * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
        yv = tl.load(y_ptr + t * sy0 + cols, mask=in_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * sy0 + cols, (yv + delta).to(y_ptr.dtype.element_ty), mask=in_n)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """The op table's ``lora_shrink`` (contract/ops.py): x [T, in], lora_a [S, N, in] -> [T, N]."""
    t, k = x.shape
    n = lora_a.shape[1]
    out = torch.empty(t, n, dtype=lora_a.dtype, device=x.device)
    if t == 0:
        return out
    x, lora_a = x.contiguous(), lora_a.contiguous()
    grid = (t, triton.cdiv(n, BLOCK_N))
    _shrink_kernel[grid](x, lora_a, out, mapping.token_slots, n, k, x.stride(0),
                         lora_a.stride(0), lora_a.stride(1), out.stride(0),
                         BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


_rows_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _slice_rows_tensor(slice_rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """The slice boundaries on the device, made once per (device, boundaries): a graph replays
    the pointer it captured."""
    key = (device, tuple(int(r) for r in slice_rows))
    if key not in _rows_cache:
        _rows_cache[key] = torch.tensor(key[1], dtype=torch.int32, device=device)
    return _rows_cache[key]


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                mapping: LoRAMapping, slice_rows: Sequence[int]) -> None:
    """The op table's ``lora_expand``: y [T, out] += per-slice (h block @ B^T) * scale."""
    t, out = y.shape
    num_slices = len(slice_rows) - 1
    if t == 0:
        return
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"lora_expand: {num_slices} stacked slices, at most {MAX_SLICES}")
    if y.stride(1) != 1:
        raise ValueError("lora_expand: y must be contiguous along its outputs")
    h, lora_b, scales = h.contiguous(), lora_b.contiguous(), scales.contiguous()
    rank = lora_b.shape[2]
    rows = _slice_rows_tensor(slice_rows, y.device)
    grid = (t, triton.cdiv(out, BLOCK_N))
    _expand_kernel[grid](y, h, lora_b, scales, mapping.token_slots, rows, out, rank, y.stride(0),
                         h.stride(0), lora_b.stride(0), lora_b.stride(1), scales.stride(0),
                         NUM_SLICES=num_slices, BLOCK_N=BLOCK_N,
                         BLOCK_R=max(16, triton.next_power_of_2(min(rank, 64))))
