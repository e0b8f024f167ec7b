"""The ops table's fused entries (models/layers/ops.py): by default rms_norm_linear and
silu_and_mul_linear run the table's own rms_norm / silu_and_mul and linear, so a backend that
registers only those still gets them inside the fused entries."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers import ops as reference
from pagedllm.models.layers.ops import Ops


def _layer(n: int, k: int, bias: bool) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(n * k)
    return SimpleNamespace(weight=torch.randn(n, k, generator=gen),
                           bias=torch.randn(n, generator=gen) if bias else None)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_linear_default_is_the_two_ops(with_residual: bool) -> None:
    x, r, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
    layer = _layer(40, 64, True)
    residual = r if with_residual else None
    y, new_residual = Ops().rms_norm_linear(x, w, 1e-6, residual, layer)
    h, want_residual = reference.rms_norm(x, w, 1e-6, residual)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(y, F.linear(h, layer.weight, layer.bias))


def test_silu_and_mul_linear_default_is_the_two_ops() -> None:
    x, layer = torch.randn(2, 96), _layer(16, 48, False)
    assert torch.equal(Ops().silu_and_mul_linear(x, layer),
                       F.linear(reference.silu_and_mul(x), layer.weight))


def test_fused_defaults_use_the_registered_ops() -> None:
    table, calls = Ops(), []

    def traced(name, fn):
        def run(*args):
            calls.append(name)
            return fn(*args)
        return run

    for name in ("rms_norm", "silu_and_mul", "linear"):
        table.register(name, traced(name, getattr(reference, name)))
    x = torch.randn(1, 32)
    table.rms_norm_linear(x, torch.ones(32), 1e-6, None, _layer(64, 32, False))
    table.silu_and_mul_linear(torch.randn(1, 64), _layer(8, 32, False))
    assert calls == ["rms_norm", "linear", "silu_and_mul", "linear"]
    with pytest.raises(ValueError, match="unknown op 'norm_linear'; known ops: rms_norm"):
        table.register("norm_linear", reference.linear)
