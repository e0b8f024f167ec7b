"""Triton fused_moe (grouped by expert) against the torch reference op. Runs on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) when no GPU is present,
on a CUDA machine with the compiled kernel. Skipped without triton."""
from __future__ import annotations

import pytest
import torch

from triton_env import triton_device

DEVICE = triton_device()  # before a kernel module imports triton

from pagedllm.backends.cuda.triton_moe import align_by_expert, fused_moe  # noqa: E402
from pagedllm.models.layers import moe_ops  # noqa: E402


def _case(tokens: int, experts: int, hidden: int, inter: int, seed: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    return tuple(t.to(DEVICE, dtype) for t in (x, w13, w2, logits))


@pytest.mark.parametrize("tokens,experts,topk,hidden,inter", [
    (1, 8, 2, 64, 32),     # one decode token
    (21, 8, 2, 48, 40),    # sizes that are not multiples of the blocks
    (40, 4, 1, 32, 32),    # top-1, every expert busy
    (3, 16, 4, 32, 64),    # more experts than pairs: most get none
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_reference_float32(tokens, experts, topk, hidden, inter, renormalize) -> None:
    x, w13, w2, logits = _case(tokens, experts, hidden, inter, tokens + topk, torch.float32)
    ref = moe_ops.fused_moe(x.cpu(), w13.cpu(), w2.cpu(), logits.cpu(), topk, renormalize)
    out = fused_moe(x, w13, w2, logits, topk, renormalize)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu", reason="half-precision dot in the interpreter is slow")
def test_matches_reference_bfloat16() -> None:
    x, w13, w2, logits = _case(64, 8, 128, 96, 0, torch.bfloat16)
    ref = moe_ops.fused_moe(x.float(), w13.float(), w2.float(), logits.float(), 2, True)
    torch.testing.assert_close(fused_moe(x, w13, w2, logits, 2, True).float(), ref,
                               rtol=3e-2, atol=3e-2)


def test_align_by_expert_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 = token * 2 + slot
    pair_ids, block_expert = align_by_expert(ids, 4, block_m=4)
    assert block_expert.tolist() == [0, 1, 2]  # expert 3 has no pairs, no block
    assert pair_ids.tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]


def test_empty_batch() -> None:
    x, w13, w2, logits = _case(1, 4, 32, 32, 0, torch.float32)
    assert fused_moe(x[:0], w13, w2, logits[:0], 2, True).shape == (0, 32)
