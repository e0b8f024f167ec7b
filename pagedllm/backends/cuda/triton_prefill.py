"""Prefill attention over a paged context (prefix caching, chunked prefill) as a Triton kernel.

Sequence i of the batch has context_lens[i] tokens already in the paged KV cache, followed by
query_len_i = query_start_loc[i + 1] - query_start_loc[i] new tokens packed into q/k/v. New token t
(0-based among the new ones, absolute position context_lens[i] + t) attends to all cached context
tokens and to new tokens 0..t (causal).

Design: two loops per program, as in vLLM's prefix-prefill kernel. The cached context is read from
the paged cache through the block table; the new tokens' K/V are read from the packed k/v tensors.
So the kernel does not depend on whether the new K/V were already written into the cache (the engine
does write them before attention, and that is fine: those slots are simply not read here).

Programs: grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)); each handles BLOCK_M query rows
of one head; GQA maps head h to kv head h // (num_heads // num_kv_heads). Head sizes that are not a
power of two are padded to one inside the kernel with masks. Softmax is the online (flash) form in
float32; float32 inputs use IEEE float32 dot products (no TF32).

Optional features (constexpr switches, so plain layers compile without them): a sliding window (the
query at absolute position p sees keys at positions > p - window; key tiles wholly before every
row's window are skipped) and a logit soft cap (scaled scores s -> cap * tanh(s / cap)).

Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests exercise it without a GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch


@triton.jit
def _online_softmax_step(q, k, v, qk_mask, m_i, l_i, acc, scale, soft_cap,
                         DOT_PRECISION: tl.constexpr, USE_SOFT_CAP: tl.constexpr):
    """One key tile: k [HEAD_PAD, BLOCK_N], v [BLOCK_N, HEAD_PAD]; qk_mask [BLOCK_M, BLOCK_N]."""
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:  # cap * tanh(qk / cap), tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates cleanly)
        qk = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * qk / soft_cap) + 1.0))
    qk = tl.where(qk_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: keep zeros
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _context_attention_kernel(
    Q, K, V, Out, KCache, VCache, BlockTables, QueryStartLoc, ContextLens,
    scale, window, soft_cap,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // QUERIES_PER_KV

    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    ctx_len = tl.load(ContextLens + seq)
    if m_block * BLOCK_M >= q_len:
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows, 0-based among new tokens
    offs_d = tl.arange(0, HEAD_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_SIZE

    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # 1) Cached context: positions [0, ctx_len), gathered through the block table; no causal mask.
    # With a window, the first row (position ctx_len + m_block * BLOCK_M) sees nothing before
    # position ctx_len + m_block * BLOCK_M - window + 1: earlier tiles are skipped.
    ctx_from = 0
    if USE_WINDOW:
        ctx_from = tl.maximum(ctx_len + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(ctx_from, ctx_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx_len
        visible = mask_n[None, :]
        if USE_WINDOW:  # key position offs_n > query position (ctx_len + offs_m) - window
            visible = visible & (offs_n[None, :] > ctx_len + offs_m[:, None] - window)
        block = tl.load(BlockTables + seq * stride_bt + offs_n // CACHE_BLOCK, mask=mask_n, other=0)
        in_block = offs_n % CACHE_BLOCK
        k_ptrs = (KCache + block[None, :].to(tl.int64) * stride_kcb + in_block[None, :] * stride_kct
                  + kv_head * stride_kch + offs_d[:, None])
        v_ptrs = (VCache + block[:, None].to(tl.int64) * stride_vcb + in_block[:, None] * stride_vct
                  + kv_head * stride_vch + offs_d[None, :])
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [HEAD_PAD, BLOCK_N]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale, soft_cap,
                                             DOT_PRECISION, USE_SOFT_CAP)

    # 2) New tokens: keys 0..q_len-1 of this sequence from k/v, causal (key j <= query row i).
    end_n = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
    new_from = 0
    if USE_WINDOW:
        new_from = tl.maximum(m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(new_from, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < q_len
        k_ptrs = K + (q_start + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
        v_ptrs = V + (q_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        causal = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if USE_WINDOW:
            causal = causal & (offs_n[None, :] > offs_m[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, scale, soft_cap,
                                             DOT_PRECISION, USE_SOFT_CAP)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _block_sizes(head_pad: int, elem_bytes: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). On the GPU: tiles whose shared memory fits an A100 (163 KB) and an H100;
    float32 tiles are halved. The interpreter gets small tiles (it runs them with numpy)."""
    if interpret:
        return 16, 16
    block_m = 64 if head_pad <= 128 else 32
    if elem_bytes == 4:
        block_m //= 2
    return block_m, 32


def context_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache_k: torch.Tensor,
    kv_cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    validate: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Prefill attention of packed new tokens over their cached context plus themselves (causal).

    q, out: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size] (the new
    tokens' keys/values); kv_cache_k/v: [num_blocks, block_size, num_kv_heads, head_size];
    block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32 (cumulative);
    context_lens: [num_seqs] int32, tokens already cached; seq_lens: [num_seqs] int32, equal to
    context_lens + query lens (only checked when validate=True, which synchronizes).
    max_query_len: longest new-token run (computed from query_start_loc if None, a sync).
    sliding_window: a query at position p sees keys at positions > p - window; soft_cap: scaled
    scores s become cap * tanh(s / cap) (None: off, both).
    Returns out.
    """
    import os

    import torch

    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = query_start_loc.shape[0] - 1
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if k.shape != (num_tokens, num_kv_heads, head_size) or v.shape != k.shape:
        raise ValueError(f"k/v must be [{num_tokens}, {num_kv_heads}, {head_size}], got {tuple(k.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if kv_cache_k.shape[2:] != (num_kv_heads, head_size) or kv_cache_v.shape != kv_cache_k.shape:
        raise ValueError(
            f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_size}], "
            f"got {tuple(kv_cache_k.shape)} and {tuple(kv_cache_v.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("kv_cache_k", kv_cache_k),
                    ("kv_cache_v", kv_cache_v), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap!r} must be a positive number or None")
    if num_seqs <= 0 or num_tokens == 0:
        return out
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if validate and not torch.equal(seq_lens.long(), context_lens.long() + query_lens.long()):
        raise ValueError("seq_lens must equal context_lens + query lengths")
    if max_query_len is None:
        max_query_len = int(query_lens.max().item())
    if max_query_len <= 0:
        return out

    head_pad = max(16, triton.next_power_of_2(head_size))
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    block_m, block_n = _block_sizes(head_pad, q.element_size(), interpret)
    # Triton's interpreter computes bfloat16 tl.dot wrongly (3.x): there, dot in float32 instead.
    upcast = interpret and q.dtype == torch.bfloat16
    precise = q.dtype == torch.float32 or upcast
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _context_attention_kernel[grid](
        q, k, v, out, kv_cache_k, kv_cache_v, block_tables, query_start_loc, context_lens,
        float(scale), int(sliding_window or 0), float(soft_cap or 1.0),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kv_cache_k.stride(0), kv_cache_k.stride(1), kv_cache_k.stride(2),
        kv_cache_v.stride(0), kv_cache_v.stride(1), kv_cache_v.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        CACHE_BLOCK=kv_cache_k.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if precise else None,  # None: the backend default for 16-bit inputs
        UPCAST=upcast,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        num_warps=4,
    )
    return out
