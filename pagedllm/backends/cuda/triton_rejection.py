"""Speculative decoding's rejection sampler (the op table's ``rejection_sample``) as one Triton
kernel: one program per sequence, every verified position's logits read in BLOCK-wide tiles.

Per row b with n drafts (reference/rejection.py has the algorithm and the argument shapes):
  1. for each position i <= n: the row max, sum(exp(x - max)) and the first argmax (one pass,
     per-lane running state as triton_sampling.py), kept in scratch [B, K + 1];
  2. the accepted run: greedy rows while draft == argmax; random rows while u * q(x) < p(x) with
     p(x) = exp(x_d - max) / sumexp (q = 1 for deterministic drafts);
  3. the last token at position n_acc: greedy rows its argmax; random rows argmax(w / noise)
     over the vocabulary with w = max(0, p - q) after a rejection (p with the draft removed for
     deterministic drafts), w = p for the bonus token, p where w vanishes everywhere.
Randomness is only the caller's uniform and noise. Ties keep the smallest index, as torch.argmax.

Runs on CPU tensors under TRITON_INTERPRET=1 (tests/backends/test_triton_rejection.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _row_stats(row_ptr, vocab, BLOCK: tl.constexpr):
    """(max, sum(exp(x - max)), first argmax) of one row of ``vocab`` float logits."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    idx = tl.full([BLOCK], _NO_INDEX, dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        grows = x > m  # strict: an equal later element keeps the earlier index
        # e <= 1 always: exp(m - x) rescales s when x is the new max, exp(x - m) is x's term;
        # while m is -inf s == 0, and 0 stands in for m (no -inf - -inf)
        e = tl.exp(-tl.abs(x - tl.where(m == float("-inf"), 0.0, m)))
        s = tl.where(grows, s * e + 1.0, s + e)
        idx = tl.where(grows, offs, idx)
        m = tl.where(grows, x, m)
    m_all = tl.max(m, axis=0)
    i_all = tl.min(tl.where(m == m_all, idx, _NO_INDEX), axis=0)
    scale = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    return m_all, tl.sum(s * scale, axis=0), i_all


@triton.jit
def _rejection_kernel(
    Logits, stride_lb, stride_lk, Drafts, stride_db, NumDrafts, DraftProbs, stride_qb,
    stride_qk, IsGreedy, Uniform, stride_ub, Noise, stride_nb, Out, stride_ob, Stats, ArgMax,
    vocab, k1,
    HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = Logits + b.to(tl.int64) * stride_lb
    n = tl.load(NumDrafts + b).to(tl.int32)
    greedy = tl.load(IsGreedy + b) != 0
    for i in range(0, k1):  # 1. statistics of every verified position
        if i <= n:
            m, s, a = _row_stats(row + i * stride_lk, vocab, BLOCK)
            tl.store(Stats + (b * k1 + i) * 2, m)
            tl.store(Stats + (b * k1 + i) * 2 + 1, s)
            tl.store(ArgMax + b * k1 + i, a)
    n_acc = 0
    going = 1
    for i in range(0, k1 - 1):  # 2. the accepted run
        if i < n:
            d = tl.load(Drafts + b * stride_db + i).to(tl.int32)
            if greedy:
                acc = d == tl.load(ArgMax + b * k1 + i)
            else:
                m = tl.load(Stats + (b * k1 + i) * 2)
                s = tl.load(Stats + (b * k1 + i) * 2 + 1)
                p = tl.exp(tl.load(row + i * stride_lk + d).to(tl.float32) - m) / s
                q = 1.0
                if HAS_Q:
                    q = tl.load(DraftProbs + b * stride_qb + i * stride_qk + d).to(tl.float32)
                acc = tl.load(Uniform + b * stride_ub + i) * q < p
            going = going * acc.to(tl.int32)
            n_acc += going
    last = tl.load(ArgMax + b * k1 + n_acc)
    if not greedy:  # 3. the recovered or bonus token of a random row
        m = tl.load(Stats + (b * k1 + n_acc) * 2)
        s = tl.load(Stats + (b * k1 + n_acc) * 2 + 1)
        rejected = n_acc < n
        d = tl.load(Drafts + b * stride_db + tl.minimum(n_acc, k1 - 2)).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        best_w = tl.full([BLOCK], -1.0, dtype=tl.float32)
        arg_w = tl.full([BLOCK], _NO_INDEX, dtype=tl.int32)
        best_p = tl.full([BLOCK], -1.0, dtype=tl.float32)
        arg_p = tl.full([BLOCK], _NO_INDEX, dtype=tl.int32)
        total_w = tl.zeros([BLOCK], dtype=tl.float32)
        pos_row = row + n_acc * stride_lk
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            valid = offs < vocab
            x = tl.load(pos_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - m) / s
            if HAS_Q:
                q = tl.load(DraftProbs + b * stride_qb + tl.minimum(n_acc, k1 - 2) * stride_qk
                            + offs, mask=valid, other=0.0).to(tl.float32)
                w = tl.where(rejected, tl.maximum(p - q, 0.0), p)
            else:
                w = tl.where(rejected & (offs == d), 0.0, p)
            w = tl.where(valid, w, 0.0)
            noise = tl.load(Noise + b * stride_nb + offs, mask=valid, other=1.0).to(tl.float32)
            sw = tl.where(valid, w / noise, -1.0)
            sp = tl.where(valid, p / noise, -1.0)
            up_w = sw > best_w
            arg_w = tl.where(up_w, offs, arg_w)
            best_w = tl.where(up_w, sw, best_w)
            up_p = sp > best_p
            arg_p = tl.where(up_p, offs, arg_p)
            best_p = tl.where(up_p, sp, best_p)
            total_w += w
        bw = tl.max(best_w, axis=0)
        bp = tl.max(best_p, axis=0)
        iw = tl.min(tl.where(best_w == bw, arg_w, _NO_INDEX), axis=0)
        ip = tl.min(tl.where(best_p == bp, arg_p, _NO_INDEX), axis=0)
        last = tl.where(tl.sum(total_w, axis=0) > 0, iw, ip)
    out = Out + b * stride_ob
    for i in range(0, k1):
        tok = tl.load(Drafts + b * stride_db + tl.minimum(i, k1 - 2), mask=i < k1 - 1,
                      other=0).to(tl.int64)
        val = tl.where(i < n_acc, tok, tl.where(i == n_acc, last.to(tl.int64), -1))
        tl.store(out + i, val)


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     is_greedy: torch.Tensor, uniform: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
    """The op table's ``rejection_sample`` (contract/ops.py) in one launch."""
    b, k1, vocab = target_logits.shape
    device = target_logits.device
    if k1 == 1:  # nothing to verify: the reference's plain draw
        from pagedllm.reference.rejection import rejection_sample as reference

        return reference(target_logits, draft_token_ids, num_draft_tokens, draft_probs,
                         is_greedy, uniform, noise)
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    drafts = draft_token_ids.contiguous()
    out = torch.empty((b, k1), dtype=torch.int64, device=device)
    stats = torch.empty((b, k1, 2), dtype=torch.float32, device=device)
    argmax = torch.empty((b, k1), dtype=torch.int32, device=device)
    q = draft_probs.contiguous() if draft_probs is not None else logits  # unused without HAS_Q
    uni = uniform.contiguous()
    noi = noise.contiguous()
    _rejection_kernel[(b,)](
        logits, logits.stride(0), logits.stride(1), drafts, drafts.stride(0),
        num_draft_tokens.contiguous(), q, q.stride(0), q.stride(1),
        is_greedy.to(torch.int8).contiguous(), uni, uni.stride(0), noi, noi.stride(0), out,
        out.stride(0), stats, argmax, vocab, k1,
        HAS_Q=draft_probs is not None, BLOCK=BLOCK)
    return out
