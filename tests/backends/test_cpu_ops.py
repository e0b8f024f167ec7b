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
    weight = torch.randn(96, 64, generator=gen).to(dtype)  # the reference's own copy:
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)  # prepare releases this one
    layer.bias = (nn.Parameter(torch.randn(96, generator=gen).to(dtype), requires_grad=False)
                  if bias else None)
    ops.linear_prepare(layer)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        out = torch.full((rows, 96), float("nan"), dtype=dtype)
        out.copy_(ops.linear(x, layer))
        ref = x.double() @ weight.double().T + (layer.bias.double() if bias else 0)
        assert out.dtype == dtype and not out.isnan().any()
        err = (out.double() - ref).norm() / ref.norm()
        assert err < tol, (dtype, rows, err)


def _route_setter(monkeypatch, env: str, cached):
    """A function setting the environment variable ``env`` (None: unset) and clearing the
    lru_cache of ``cached``, the choice that reads it."""
    def set_route(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        cached.cache_clear()
    return set_route


@pytest.fixture
def half_route(monkeypatch):
    """Sets PAGEDLLM_CPU_HALF_LINEAR (None: unset) with a fresh cached choice."""
    yield _route_setter(monkeypatch, ops.HALF_LINEAR_ENV, ops.half_compute_dtype)
    ops.half_compute_dtype.cache_clear()


@pytest.mark.parametrize("route", ["native", "float32", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_models_run_the_chosen_route_correctly(half_route, route, dtype) -> None:
    half_route(route)
    native_ok = ops.onednn_linear_supported(dtype)
    want = {"native": dtype if native_ok else torch.float32, "float32": torch.float32}
    got = ops.half_compute_dtype(dtype)
    assert got == want[route] if route else got in (dtype, torch.float32)
    gen = torch.Generator().manual_seed(1)
    layer = nn.Module()
    weight = torch.randn(48, 32, generator=gen).to(dtype)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = None
    ops.linear_prepare(layer)
    if ops.onednn_linear_supported(torch.float32):
        assert layer.compute_dtype == got
    x = torch.randn(5, 32, generator=gen).to(dtype)
    out = ops.linear(x, layer)
    ref = x.double() @ weight.double().T
    assert out.dtype == dtype and ((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_bad_half_route_names_the_variable_and_choices(half_route) -> None:
    half_route("fast")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_HALF_LINEAR='fast'.*native.*float32"):
        ops.half_compute_dtype(torch.bfloat16)


@pytest.fixture
def fp32_route(monkeypatch):
    """Sets PAGEDLLM_CPU_FP32_LINEAR (None: unset) with a fresh cached choice."""
    yield _route_setter(monkeypatch, ops.FP32_LINEAR_ENV, ops.fp32_linear_route)
    ops.fp32_linear_route.cache_clear()


@pytest.mark.parametrize("route", ["mkl", "onednn", None])
def test_float32_routes_match_reference_at_every_row_count(fp32_route, route) -> None:
    """One MKL packing serves every row count (1 to 2100, on both sides of its batch-size hint);
    oneDNN's route where forced; unset, the faster of the two on this CPU. float64 reference,
    bias or not."""
    fp32_route(route)
    if route == "mkl" and not ops.mkl_packed_linear_supported():
        pytest.skip("torch without MKL's packed sgemm (or its packing depends on the row count)")
    chosen = ops.fp32_linear_route()
    assert chosen == route if route else chosen in ops.FP32_LINEAR_CHOICES
    gen = torch.Generator().manual_seed(3)
    for bias in (False, True):
        layer = nn.Module()
        weight = torch.randn(300, 520, generator=gen)
        layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
        layer.bias = (nn.Parameter(torch.randn(300, generator=gen), requires_grad=False)
                      if bias else None)
        ops.linear_prepare(layer)
        assert hasattr(layer, "mkl_weight") == (chosen == "mkl")
        for rows in (1, 3, 63, 64, 65, 255, 256, 257, 700, 2100):
            x = torch.randn(rows, 520, generator=gen)
            ref = x.double() @ weight.double().T + (layer.bias.double() if bias else 0)
            err = (ops.linear(x, layer).double() - ref).norm() / ref.norm()
            assert err < 1e-6, (chosen, bias, rows, err)


def test_bad_fp32_route_names_the_variable_and_choices(fp32_route) -> None:
    fp32_route("blas")
    with pytest.raises(ValueError, match=r"PAGEDLLM_CPU_FP32_LINEAR='blas' is invalid: "
                                         r"allowed values are mkl, onednn"):
        ops.fp32_linear_route()
