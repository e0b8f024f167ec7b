"""Shared LoRA op test cases (tests/lora/test_lora_ops.py, test_triton_lora.py)."""
from __future__ import annotations

import torch

from pagedllm.contract.lora import NO_LORA, LoRAMapping


def _case(t: int, slots: list[int], dtype: torch.dtype, seed: int = 0,
          slice_rows: tuple[int, ...] = (0, 24, 32, 40), rank: int = 8, num_slots: int = 4,
          k: int = 48):
    gen = torch.Generator().manual_seed(seed)
    n = len(slice_rows) - 1
    x = torch.randn(t, k, generator=gen).to(dtype)
    a = torch.randn(num_slots, n * rank, k, generator=gen).to(dtype)
    b = torch.randn(num_slots, slice_rows[-1], rank, generator=gen).to(dtype)
    # slot 1 holds a rank-3 adapter in the rank-8 slot: zeros past its rank
    a[1].view(n, rank, k)[:, 3:] = 0
    b[1, :, 3:] = 0
    scales = torch.rand(num_slots, n, generator=gen) + 0.5
    y = torch.randn(t, slice_rows[-1], generator=gen).to(dtype)
    mapping = LoRAMapping(torch.tensor(slots, dtype=torch.int32), list(slots))
    return x, a, b, scales, y, mapping


def _per_token(x, a, b, scales, y, slots, slice_rows):
    """PEFT's result + lora_B(lora_A(x)) * scaling, one token and one slice at a time."""
    y = y.clone()
    rank = b.shape[2]
    for t, s in enumerate(slots):
        if s == NO_LORA:
            continue
        for i in range(len(slice_rows) - 1):
            lo, hi = slice_rows[i], slice_rows[i + 1]
            h = x[t:t + 1] @ a[s, i * rank:(i + 1) * rank].t()
            y[t:t + 1, lo:hi] += ((h @ b[s, lo:hi].t()) * scales[s, i].item()).to(y.dtype)
    return y


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: 1e-5; half: 2% of the largest magnitude (the reference rounds the product to
    bf16 twice, kernels accumulate in float32 and round once)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                   atol=2e-2 * float(want.float().abs().max()) + 1e-2)


SLOT_PATTERNS = {
    "mixed": [0, 2, NO_LORA, 1, 2, 3, NO_LORA, 0],
    "one adapter": [2] * 8,
    "none": [NO_LORA] * 8,
    "contiguous runs": [1, 1, 1, 3, 3, NO_LORA, 0, 0],
}
