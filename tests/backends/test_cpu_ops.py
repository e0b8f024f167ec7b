"""The cpu backend's packed linear equals a float64 reference, in every dtype it supports."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.backends.cpu import ops


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference(dtype: torch.dtype, tol: float, bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(96, 64, generator=gen).to(dtype), requires_grad=False)
    layer.bias = (nn.Parameter(torch.randn(96, generator=gen).to(dtype), requires_grad=False)
                  if bias else None)
    ops.linear_prepare(layer)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        out = torch.full((rows, 96), float("nan"), dtype=dtype)
        out.copy_(ops.linear(x, layer))
        ref = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
        assert out.dtype == dtype and not out.isnan().any()
        err = (out.double() - ref).norm() / ref.norm()
        assert err < tol, (dtype, rows, err)
