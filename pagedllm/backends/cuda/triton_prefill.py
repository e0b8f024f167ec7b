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

Split context (``num_splits`` > 1): a short query over a long cached context runs few programs
(one sequence, 32 heads, one query block: 32 programs on a 132-SM H100, each walking 4k keys;
issue 45's question over a host-tier prefix spent 0.23 ms a layer there). The cached context is
then cut into ``num_splits`` ranges, a program per (query block, range) writes its unnormalized
partial (running max, sum, output) to a float32 scratch, the last range's program also the new
tokens, and ``_combine_splits_kernel`` merges the partials as the online softmax would have.
``context_attention_fwd`` splits by itself when the grid is under twice the GPU's SMs and the
longest context holds ``MIN_SPLIT_TOKENS`` per range (``max_context_len`` given); never under
the interpreter unless asked, nor with ``PAGEDLLM_CUDA_PREFILL_SPLIT=0``. Measured on an H100
(2026-12-08 00:03, benchmarks/RESULTS.md): a host-tier hit's TTFT p50 26.2 -> 20.0 ms, a device
prefix hit's 17.6 -> 16.0 ms (Llama-3-8B shape, 32-token questions over 4k cached tokens).

Optional features (constexpr switches, so plain layers compile without them): a sliding window (the
query at absolute position p sees keys at positions > p - window; key tiles wholly before every
row's window are skipped) and a logit soft cap (scaled scores s -> cap * tanh(s / cap)).

Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests exercise it without a GPU).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm import envs


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
    Q, K, V, Out, KCache, VCache, BlockTables, QueryStartLoc, ContextLens, TmpAcc, TmpML,
    scale, window, soft_cap, split_len,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_bt,
    stride_tmp_t,
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
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
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
    # With splits, this program reads the range [split * split_len, + split_len) of it (the last
    # range: to the end, so a short max_context_len costs balance, never keys).
    ctx_from = 0
    ctx_to = ctx_len
    if NUM_SPLITS > 1:
        ctx_from = tl.minimum(split * split_len, ctx_len)
        ctx_to = tl.where(split == NUM_SPLITS - 1, ctx_len,
                          tl.minimum(ctx_len, ctx_from + split_len))
    if USE_WINDOW:
        ctx_from = tl.maximum(ctx_from, tl.maximum(ctx_len + m_block * BLOCK_M - window + 1, 0)
                              // BLOCK_N * BLOCK_N)
    for start_n in range(ctx_from, ctx_to, BLOCK_N):
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

    # 2) New tokens: keys 0..q_len-1 of this sequence from k/v, causal (key j <= query row i);
    # with splits, in the last range's program only.
    end_n = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
    if NUM_SPLITS > 1:
        end_n = tl.where(split == NUM_SPLITS - 1, end_n, 0)
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

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    else:  # the partial: TmpAcc [tokens, heads, splits, HEAD_PAD], TmpML [tokens, heads, splits, 2]
        row = (q_start + offs_m).to(tl.int64) * stride_tmp_t + (head * NUM_SPLITS + split)
        tl.store(TmpAcc + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=mask_m[:, None])
        tl.store(TmpML + row * 2, m_i, mask=mask_m)
        tl.store(TmpML + row * 2 + 1, l_i, mask=mask_m)


@triton.jit
def _combine_splits_kernel(TmpAcc, TmpML, Out, stride_ot, stride_oh, stride_tmp_t,
                           HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Out[token, head] from the splits' partials: each weighed by exp(its max - the max)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask_s = offs_s < NUM_SPLITS
    row = token.to(tl.int64) * stride_tmp_t + head * NUM_SPLITS + offs_s
    m = tl.load(TmpML + row * 2, mask=mask_s, other=float("-inf"))
    l_s = tl.load(TmpML + row * 2 + 1, mask=mask_s, other=0.0)
    acc = tl.load(TmpAcc + row[:, None] * HEAD_PAD + offs_d[None, :], mask=mask_s[:, None],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(w * l_s, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)


MIN_SPLIT_TOKENS = 256  # cached tokens a split range holds at least
MAX_SPLITS = 16


def choose_num_splits(programs: int, max_context_len: int, multiprocessors: int) -> int:
    """Context ranges for a grid of ``programs`` (sequences x heads x query blocks): 1 where it
    fills twice the GPU's ``multiprocessors`` or the longest context is short, else enough to
    fill them, each range at least MIN_SPLIT_TOKENS, at most MAX_SPLITS."""
    target = 2 * multiprocessors
    if programs >= target or max_context_len < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(MAX_SPLITS, target // max(1, programs),
                      max_context_len // MIN_SPLIT_TOKENS))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    """The SM count of CUDA device ``index`` (None: the current one), asked once per device."""
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if index is None else index).multi_processor_count


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
    max_context_len: int | None = None,
    num_splits: int | None = None,
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
    max_context_len: the longest cached context (host value): lets a small grid split it
    (``choose_num_splits``); num_splits: force a split count (tests; 1: never split).
    Returns out.
    """
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
    if validate or max_query_len is None:  # device work and a sync: never on the engine's path
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
    q_blocks = triton.cdiv(max_query_len, block_m)
    if num_splits is None:
        sms = (_multiprocessors(q.device.index)
               if q.is_cuda and not interpret and envs.PAGEDLLM_CUDA_PREFILL_SPLIT else 0)
        num_splits = choose_num_splits(num_seqs * num_heads * q_blocks, max_context_len or 0, sms)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in 1..{MAX_SPLITS}")
    per_split = triton.cdiv(max(max_context_len or 1, 1), num_splits)
    split_len = triton.cdiv(per_split, block_n) * block_n  # whole key tiles
    if num_splits > 1 and max_context_len is None:
        raise ValueError("num_splits > 1 needs max_context_len (the longest cached context)")
    tmp_acc = tmp_ml = out  # unused without splits
    if num_splits > 1:
        tmp_acc = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32,
                              device=q.device)
        tmp_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32,
                             device=q.device)
    grid = (num_seqs, num_heads, q_blocks * num_splits)
    _context_attention_kernel[grid](
        q, k, v, out, kv_cache_k, kv_cache_v, block_tables, query_start_loc, context_lens,
        tmp_acc, tmp_ml,
        float(scale), int(sliding_window or 0), float(soft_cap or 1.0), int(split_len),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kv_cache_k.stride(0), kv_cache_k.stride(1), kv_cache_k.stride(2),
        kv_cache_v.stride(0), kv_cache_v.stride(1), kv_cache_v.stride(2),
        block_tables.stride(0),
        num_heads * num_splits,
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
        NUM_SPLITS=num_splits,
        num_warps=4,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            tmp_acc, tmp_ml, out, out.stride(0), out.stride(1), num_heads * num_splits,
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )
    return out
