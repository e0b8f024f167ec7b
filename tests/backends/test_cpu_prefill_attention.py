"""The cpu backend's C++ prefill attention (csrc/cpu/prefill_attention_cpu.cpp) and the sliding
window / logits soft cap of both C++ kernels, against a dense float64 reference.

Each case scatters every sequence's blocks over a shuffled pool; cache slots no sequence owns
and the output before the call hold NaN, so a read outside a sequence's tokens or a row left
unwritten shows up as NaN. Tests skip where the kernels cannot be built (the cpu_kernels fixture).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.backends.cpu.attention import TorchPagedAttention

NAN = float("nan")


@dataclass
class PrefillCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]: every sequence's queries, packed
    cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    starts: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context + queries
    scale: float


def make_case(chunks: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
              head_size: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> PrefillCase:
    """``chunks``: (cached context, new queries) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + q for c, q in chunks]
    need = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + 4
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    unused = pool[sum(need):]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), NAN)
    tables = torch.empty(len(lens), max_blocks, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(lens, need)):
        blocks, pool = pool[:nb], pool[nb:]
        tables[i] = torch.tensor(blocks + [unused[(i + j) % len(unused)]
                                           for j in range(max_blocks - nb)])
        for t in range(n):
            cache[:, blocks[t // block_size], t % block_size] = torch.randn(
                2, num_kv_heads, head_size, generator=gen)
    starts = [0]
    for _, q in chunks:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_size, generator=gen)
    return PrefillCase(query.to(dtype), cache.to(dtype), tables,
                       torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(lens, dtype=torch.int32), head_size ** -0.5)


def reference(case: PrefillCase, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    """float64, per sequence: query j (position context + j) over keys k <= its position (and
    k > position - window); scores scale * q.k, then soft_cap * tanh(s / soft_cap)."""
    block_size, num_kv_heads, head_size = case.cache.shape[2:]
    group = case.query.shape[1] // num_kv_heads
    out = []
    for i, n in enumerate(case.seq_lens.tolist()):
        q0, q1 = case.starts[i].item(), case.starts[i + 1].item()
        context = n - (q1 - q0)
        blocks = case.tables[i, :math.ceil(n / block_size)].long()
        k, v = (case.cache[j, blocks].reshape(-1, num_kv_heads, head_size)[:n].double()
                .repeat_interleave(group, dim=1) for j in (0, 1))  # [n, num_heads, head_size]
        s = torch.einsum("qhd,khd->hqk", case.query[q0:q1].double(), k) * case.scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = context + torch.arange(q1 - q0)[:, None]
        key = torch.arange(n)[None, :]
        visible = key <= pos
        if window:
            visible &= key > pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(out)


def run_prefill(ops, case: PrefillCase, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    out = torch.full_like(case.query, NAN)
    ops.paged_attention_prefill(out, case.query, case.cache, case.tables, case.starts,
                                case.seq_lens, case.scale, window, soft_cap)
    return out


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert got.dtype == dtype and not got.isnan().any(), "NaN in the output"
    err = (got.double() - ref).abs()
    assert bool((err <= tol + tol * ref.abs()).all()), f"max |error| {err.max().item():.3g}"


# (context, queries): one token, under a tile, ragged lengths past the 16-query and 32-key
# tiles, cached context (prefix hit / later chunk) with few and many new tokens
CHUNKS = [(0, 1), (0, 7), (0, 53), (0, 16), (16, 20), (37, 1), (5, 40), (64, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_prefill_matches_reference(cpu_kernels, heads: tuple[int, int], block_size: int,
                                   dtype: torch.dtype) -> None:
    case = make_case(CHUNKS, num_heads=heads[0], num_kv_heads=heads[1], head_size=64,
                     block_size=block_size, dtype=dtype, seed=block_size)
    assert_close(run_prefill(cpu_kernels, case), reference(case), dtype)


@pytest.mark.parametrize("head_size", [36, 128])  # scalar tails; the 64-wide chunk twice
def test_prefill_other_head_sizes(cpu_kernels, head_size: int) -> None:
    case = make_case(CHUNKS[:5], num_heads=6, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=torch.float32, seed=head_size)
    assert_close(run_prefill(cpu_kernels, case), reference(case), torch.float32)


@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (5, 0.0), (24, 0.0), (0, 2.0),
                                             (7, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_window_and_soft_cap(cpu_kernels, window: int, soft_cap: float,
                                     dtype: torch.dtype) -> None:
    case = make_case(CHUNKS, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=window)
    # scores large enough that a soft cap of 2 changes them a lot
    case.query = (case.query.float() * 4).to(dtype)
    ref = reference(case, window, soft_cap)
    assert_close(run_prefill(cpu_kernels, case, window, soft_cap), ref, dtype)
    if window or soft_cap:  # the features change the result (the test can fail)
        assert (ref - reference(case)).abs().max() > 1e-2


@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (6, 0.0), (0, 2.0), (9, 3.0)])
def test_decode_window_and_soft_cap(cpu_kernels, window: int, soft_cap: float) -> None:
    """Decode is the prefill of one query at the end of the sequence: same reference."""
    lens = [1, 16, 33, 70]
    case = make_case([(n - 1, 1) for n in lens], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=torch.float32, seed=window + 1)
    case.query = case.query * 4
    out = torch.full_like(case.query, NAN)
    cpu_kernels.paged_attention_decode(out, case.query, case.cache, case.tables, case.seq_lens,
                                       case.scale, window, soft_cap)
    ref = reference(case, window, soft_cap)
    assert_close(out, ref, torch.float32)
    assert (ref - reference(case)).abs().max() > 1e-2


def test_prefill_rejects_bad_arguments(cpu_kernels) -> None:
    case = make_case([(0, 5), (3, 4)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32)
    out = torch.empty_like(case.query)
    bad_tables = case.tables.clone()
    bad_tables[1, 0] = case.cache.shape[1]
    with pytest.raises(RuntimeError, match=r"block_tables\[1\]\[0\]"):
        cpu_kernels.paged_attention_prefill(out, case.query, case.cache, bad_tables, case.starts,
                                            case.seq_lens, case.scale)
    with pytest.raises(RuntimeError, match="seq_len"):
        cpu_kernels.paged_attention_prefill(out, case.query, case.cache, case.tables, case.starts,
                                            torch.tensor([5, 2], dtype=torch.int32), case.scale)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        cpu_kernels.paged_attention_prefill(out, case.query, case.cache, case.tables, case.starts,
                                            case.seq_lens, case.scale, -1)


def _metadata(case: PrefillCase, block_size: int) -> AttentionMetadata:
    lens = case.seq_lens.tolist()
    q_lens = (case.starts[1:] - case.starts[:-1]).tolist()
    slots = []
    for i, (n, q) in enumerate(zip(lens, q_lens)):
        slots += [case.tables[i, p // block_size].item() * block_size + p % block_size
                  for p in range(n - q, n)]
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        num_prefills=len(lens), num_prefill_tokens=case.query.shape[0], num_decode_tokens=0,
        slot_mapping=torch.tensor(slots), block_size=block_size, query_start_loc=case.starts,
        prefill_seq_lens=case.seq_lens,
        prefill_context_lens=torch.tensor([n - q for n, q in zip(lens, q_lens)],
                                          dtype=torch.int32),
        prefill_block_tables=case.tables, max_prefill_query_len=max(q_lens),
        max_prefill_seq_len=max(lens), decode_seq_lens=empty,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int32), max_decode_seq_len=0,
        prefill_query_lens_list=q_lens, prefill_seq_lens_list=lens,
        prefill_context_lens_list=[n - q for n, q in zip(lens, q_lens)])


def test_native_prefill_equals_torch_reference(cpu_kernels) -> None:
    """The native attention class's prefill (the kernel) against the torch attention class."""
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    case = make_case(CHUNKS, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32, seed=3)
    meta = _metadata(case, 16)
    k, v = case.cache[0].clone(), case.cache[1].clone()  # unused: K/V are read from the cache
    kw = dict(sliding_window=12, logits_soft_cap=4.0)
    native = CpuNativePagedAttention(8, 64, 2, case.scale, **kw)
    torch_ref = TorchPagedAttention(8, 64, 2, case.scale, **kw)
    got = native.prefill(case.query, case.cache, meta, k, v)
    want = torch_ref.prefill(case.query, case.cache.nan_to_num(), meta, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
