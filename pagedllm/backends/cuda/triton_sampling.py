"""Greedy sampling with the chosen token's logprob in one read of the logits, as Triton kernels.

Replaces, for an all-greedy batch, ``log_softmax`` (writes a [rows, vocab] tensor) + ``argmax``
(reads it again) + ``gather``: the chosen token is the row's argmax, so its logit is the row max
and its logprob is ``max - logsumexp = -log(sum_v exp(x_v - max))``. Only that sum and the
argmax are needed.

Two stages, so that a single row still spreads over many SMs:
  1. grid (rows, splits): each program scans a contiguous slice of its row in BLOCK-wide tiles.
     Each lane keeps a running max, the first index reaching it and sum(exp(x - max)), rescaled
     whenever the max grows (one exp per element, no cross-lane reduction inside the loop). At
     the end the lanes are combined and (max, argmax, sumexp) go to scratch [rows, splits].
  2. grid (rows,): combines a row's partials the same way and writes the token and logprob.
When a row needs one split (small vocab, or many rows) stage 1 writes the results itself.

Ties: every combine keeps the smallest index among those reaching the max, as ``torch.argmax``.
-inf logits (masked tokens) are allowed; +inf and NaN are not (raw logits never hold them).

Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests exercise it without a GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

BLOCK = 2048  # elements per tile; 8 warps -> 8 float32 per thread (two 16-byte loads)
NUM_WARPS = 8
# Aim for rows * splits ~ 4 programs per SM of an H200 (132 SMs), so one row still fills the GPU.
TARGET_PROGRAMS = 528
_NO_INDEX = tl.constexpr(2**31 - 1)  # int32 max: "no index reaches the max yet"; loses every min()


@triton.jit
def _combine(m, s, idx):
    """Lane/partial states -> one: m [N] maxima, s [N] sum(exp(x - m)), idx [N] first argmax.
    Returns (max, sumexp relative to max, smallest index reaching max)."""
    m_all = tl.max(m, axis=0)
    i_all = tl.min(tl.where(m == m_all, idx, _NO_INDEX), axis=0)
    # states that saw only -inf have m == -inf, s == 0 and scale 0; 0 stands in for an all -inf
    # m_all so that -inf - -inf (NaN) never appears
    scale = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    s_all = tl.sum(s * scale, axis=0)
    return m_all, s_all, i_all


@triton.jit
def _store_result(Tokens, Logprobs, row, s_all, i_all):
    # the chosen token's logit is the row max: logprob = max - (max + log(sumexp))
    tl.store(Tokens + row, tl.where(i_all == _NO_INDEX, 0, i_all).to(tl.int64))
    tl.store(Logprobs + row, -tl.log(s_all))


@triton.jit
def _partials_kernel(
    Logits, PartMax, PartSum, PartIdx, Tokens, Logprobs,
    vocab, stride_row, split_len, num_splits,
    BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * split_len  # split_len is a multiple of BLOCK
    hi = tl.minimum(lo + split_len, vocab)
    row_ptr = Logits + row.to(tl.int64) * stride_row

    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # [BLOCK] per-lane running max
    s = tl.zeros([BLOCK], dtype=tl.float32)  # [BLOCK] sum(exp(x - m)) over the lane's elements
    idx = tl.full([BLOCK], _NO_INDEX, dtype=tl.int32)  # [BLOCK] first index of m in the lane
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        grows = x > m  # strict: an equal later element keeps the earlier index
        # e = exp(m - x) when x is the new max (rescales s), exp(x - m) otherwise (x's term).
        # While m is -inf, s == 0, so any finite e will do: 0 stands in for m there, which
        # keeps -inf - -inf (NaN) out; x == -inf then gives e == 0.
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        e = tl.exp(-tl.abs(x - m_ref))
        s = tl.where(grows, s * e + 1.0, s + e)
        idx = tl.where(grows, offs, idx)
        m = tl.where(grows, x, m)

    m_all, s_all, i_all = _combine(m, s, idx)
    if FINAL:
        _store_result(Tokens, Logprobs, row, s_all, i_all)
    else:
        part = row * num_splits + split
        tl.store(PartMax + part, m_all)
        tl.store(PartSum + part, s_all)
        tl.store(PartIdx + part, i_all)


@triton.jit
def _finish_kernel(
    PartMax, PartSum, PartIdx, Tokens, Logprobs,
    num_splits,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    mask = offs < num_splits
    part = row * num_splits + offs
    m = tl.load(PartMax + part, mask=mask, other=float("-inf"))  # [SPLITS_PAD]
    s = tl.load(PartSum + part, mask=mask, other=0.0)
    idx = tl.load(PartIdx + part, mask=mask, other=_NO_INDEX)
    _, s_all, i_all = _combine(m, s, idx)
    _store_result(Tokens, Logprobs, row, s_all, i_all)


def split_plan(rows: int, vocab: int) -> tuple[int, int]:
    """(splits, split_len): each row is cut into ``splits`` slices of ``split_len`` elements (a
    multiple of BLOCK; the last slice may be shorter, none is empty); rows * splits is about
    TARGET_PROGRAMS, or 1 split per row once rows alone reach it."""
    tiles = triton.cdiv(vocab, BLOCK)
    splits = min(max(triton.cdiv(TARGET_PROGRAMS, rows), 1), tiles)
    tiles_per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * BLOCK


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] float32 (float16/bfloat16 also read, math in float32; row stride may
    exceed vocab; last dim contiguous) ->
    (tokens [rows] int64: argmax of each row, the FIRST index on ties, like torch.argmax;
     logprobs [rows] float32: logits[row, token] - logsumexp(logits[row])).
    Nothing here waits for the device (CUDA-graph capturable)."""
    import torch

    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits dtype {logits.dtype} is not one of float32, float16, bfloat16")
    rows, vocab = logits.shape
    if not 0 < vocab < 2**31 - 1:
        raise ValueError(f"vocab={vocab} must be in [1, {2**31 - 2}]")
    if logits.stride(1) != 1 and rows > 0:
        raise ValueError(
            f"logits must be contiguous in its last dimension, got strides {logits.stride()}")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs

    splits, split_len = split_plan(rows, vocab)
    if splits == 1:
        _partials_kernel[(rows, 1)](
            logits, logprobs, logprobs, tokens, tokens, logprobs,  # no scratch: results direct
            vocab, logits.stride(0), split_len, 1,
            BLOCK=BLOCK, FINAL=True, num_warps=NUM_WARPS,
        )
        return tokens, logprobs
    part_max = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    _partials_kernel[(rows, splits)](
        logits, part_max, part_sum, part_idx, tokens, logprobs,
        vocab, logits.stride(0), split_len, splits,
        BLOCK=BLOCK, FINAL=False, num_warps=NUM_WARPS,
    )
    _finish_kernel[(rows,)](
        part_max, part_sum, part_idx, tokens, logprobs,
        splits,
        SPLITS_PAD=triton.next_power_of_2(splits), num_warps=1,
    )
    return tokens, logprobs
