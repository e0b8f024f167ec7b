"""The Triton token-bitmask kernel (cuda backend) vs the ops registry's torch reference, bit for
bit, on CPU through Triton's interpreter when no GPU is present."""
from __future__ import annotations

import pytest
import torch

from triton_env import triton_device

DEVICE = triton_device()  # before a kernel module imports triton

from pagedllm.backends.cuda.triton_bitmask import BLOCK, apply_token_bitmask  # noqa: E402
from pagedllm.models.layers.ops import apply_token_bitmask as reference  # noqa: E402


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 1000), (2, BLOCK + 33), (5, 3 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] |= -2**31  # bit 31 set: a negative word
    if rows > 2:
        bitmask[1] = -1
        bitmask[2] = 0
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    want = logits.clone()
    reference(want, bitmask)
    wide = torch.zeros(rows, vocab + 7, dtype=dtype)
    wide[:, :vocab] = logits
    for got in (logits.to(DEVICE), wide.to(DEVICE)[:, :vocab]):
        apply_token_bitmask(got, bitmask.to(DEVICE))
        assert torch.equal(got.cpu(), want)
