"""Triton prefill-over-paged-context kernel vs a float64 reference.

Runs on CPU through Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported)
when no GPU is present; on a CUDA machine it runs the compiled kernel. Skipped without triton.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
from kernel_reference import prefill_ref  # noqa: E402

from pagedllm.backends.cuda.triton_prefill import context_attention_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _make_case(context_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
               head_size: int, block_size: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    num_tokens = sum(query_lens)
    blocks_per_seq = [max(1, -(-c // block_size)) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # A random permutation so that sequences use scattered, non-contiguous blocks.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    case = dict(
        q=rnd(num_tokens, num_heads, head_size),
        k=rnd(num_tokens, num_kv_heads, head_size),
        v=rnd(num_tokens, num_kv_heads, head_size),
        kv_cache_k=rnd(num_blocks, block_size, num_kv_heads, head_size),
        kv_cache_v=rnd(num_blocks, block_size, num_kv_heads, head_size),
        block_tables=block_tables,
        query_start_loc=qsl,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32),
    )
    return {name: t.to(DEVICE) for name, t in case.items()}


@pytest.mark.parametrize(
    "dtype,head_size,num_heads,num_kv_heads,block_size",
    [
        (torch.float32, 64, 4, 2, 16),   # GQA
        (torch.float16, 80, 2, 2, 16),   # MHA, head size padded to 128
        (torch.bfloat16, 64, 4, 1, 32),  # MQA
    ],
)
def test_context_attention_matches_reference(dtype: torch.dtype, head_size: int, num_heads: int,
                                             num_kv_heads: int, block_size: int) -> None:
    # Sequences: no context (plain prefill), a context ending mid-block, a long-ish prefix.
    context_lens, query_lens = [0, 21, 37], [19, 5, 17]
    case = _make_case(context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size,
                      dtype, seed=head_size + num_heads)
    _check_against_reference(case, head_size**-0.5, TOL[dtype])


def _check_against_reference(case: dict, scale: float, tol: float, **kwargs) -> None:
    """The kernel over ``case`` (keyword arguments passed on) equals prefill_ref everywhere."""
    out = torch.full_like(case["q"], float("nan"))
    context_attention_fwd(case["q"], case["k"], case["v"], out, case["kv_cache_k"],
                          case["kv_cache_v"], case["block_tables"], case["query_start_loc"],
                          case["seq_lens"], case["context_lens"], scale, validate=True, **kwargs)
    ref = prefill_ref(case["q"], case["k"], case["v"], case["kv_cache_k"], case["kv_cache_v"],
                      case["block_tables"], case["query_start_loc"].cpu(),
                      case["context_lens"].cpu(), scale)
    assert not torch.isnan(out).any(), "some output elements were not written"
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol)


def test_context_attention_rejects_bad_shapes() -> None:
    case = _make_case([3], [4], 4, 2, 64, 16, torch.float32, seed=0)
    out = torch.empty_like(case["q"])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        context_attention_fwd(case["q"][:, :3], case["k"], case["v"], out[:, :3], case["kv_cache_k"],
                              case["kv_cache_v"], case["block_tables"], case["query_start_loc"],
                              case["seq_lens"], case["context_lens"], 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        context_attention_fwd(case["q"], case["k"], case["v"], out, case["kv_cache_k"],
                              case["kv_cache_v"], case["block_tables"], case["query_start_loc"],
                              case["seq_lens"] + 1, case["context_lens"], 1.0, validate=True)


@pytest.mark.parametrize("num_splits,max_context_len", [(2, 300), (3, 300), (7, 300),
                                                        (4, 64)])  # 64: under-reported
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_context_matches_reference(num_splits: int, max_context_len: int,
                                         dtype: torch.dtype) -> None:
    """The cached context cut into ranges whose partials are merged (issue 45: a short query over
    a long prefix): no context, a short one whose later ranges are empty, a long one; a
    max_context_len below the real one still reads every key (the last range runs to the end)."""
    context_lens, query_lens = [0, 21, 300], [3, 5, 17]
    case = _make_case(context_lens, query_lens, 4, 2, 64, 16, dtype, seed=num_splits)
    _check_against_reference(case, 64 ** -0.5, TOL[dtype], max_context_len=max_context_len,
                             num_splits=num_splits)


def test_split_count_fills_the_gpu_only_for_small_grids() -> None:
    from pagedllm.backends.cuda.triton_prefill import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(32, 4096, 132) == 8  # one sequence, 32 heads, a short question
    assert choose_num_splits(32, 300, 132) == 1  # short context: nothing to split
    assert choose_num_splits(512, 4096, 132) == 1  # the grid already fills the GPU
    assert choose_num_splits(1, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(8, 1024, 132) == 4  # each range keeps MIN_SPLIT_TOKENS
    assert choose_num_splits(32, 4096, 0) == 1  # the interpreter: no GPU, no split


def test_split_arguments_are_checked() -> None:
    case = _make_case([40], [4], 4, 2, 64, 16, torch.float32, seed=0)
    out = torch.empty_like(case["q"])
    args = (case["q"], case["k"], case["v"], out, case["kv_cache_k"], case["kv_cache_v"],
            case["block_tables"], case["query_start_loc"], case["seq_lens"],
            case["context_lens"], 1.0)
    with pytest.raises(ValueError, match="num_splits=17 must be in 1..16"):
        context_attention_fwd(*args, max_context_len=40, num_splits=17)
    with pytest.raises(ValueError, match="num_splits > 1 needs max_context_len"):
        context_attention_fwd(*args, num_splits=2)
