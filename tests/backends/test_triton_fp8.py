"""The Triton per-token FP8 quantization (cuda backend's FP8 linears) vs the torch arithmetic it
replaces, bit for bit; on CPU through Triton's interpreter when no GPU is present, up to the
rounding to e4m3, which the interpreter gets wrong (the GPU run checks the codes)."""
from __future__ import annotations

import pytest
import torch

from triton_env import triton_device

DEVICE = triton_device()  # before a kernel module imports triton

from pagedllm.backends.cuda.quant_ops import torch_fp8_rows  # noqa: E402
from pagedllm.backends.cuda.triton_fp8 import BLOCK, fp8_rows  # noqa: E402


@pytest.mark.parametrize("rows, cols", [(1, 16), (5, 1000), (3, 2 * BLOCK + 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch(rows: int, cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols + 5, generator=gen) * 3).to(dtype)
    x[0, :3] = torch.tensor([1e4, -6e4, 1e-3]).to(dtype)  # magnitudes far from e4m3's range
    if rows > 2:
        x[1] = 0  # an all-zero row: the smallest scale, codes 0
    x = x.to(DEVICE)[:, :cols]  # strided rows
    want_q, want_s = torch_fp8_rows(x)
    # the interpreter's float8 conversion is wrong (see triton_fp8.py): there the values before it
    codes = torch.float32 if DEVICE == "cpu" else torch.float8_e4m3fn
    got_q, got_s = fp8_rows(x, codes)
    assert got_q.dtype == codes and got_s.shape == (rows, 1)
    assert torch.equal(got_s.cpu(), want_s.cpu())
    got_q, want_q = got_q.cpu(), want_q.cpu()
    if DEVICE == "cpu":
        want_scaled = (x.float().cpu() / want_s).clamp(-448.0, 448.0)
        assert torch.equal(got_q, want_scaled)
        assert torch.equal(want_scaled.to(torch.float8_e4m3fn).view(torch.uint8),
                           want_q.view(torch.uint8))  # what the GPU's conversion then gives
    else:
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
