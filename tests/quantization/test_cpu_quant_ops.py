"""The cpu backend's INT8 / INT4 weight-only kernels (backends/cpu/quant_ops.py) against a
float64 dequantized reference, the layouts they take, and the reference fallback elsewhere."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from pagedllm.backends.cpu import quant_ops
from pagedllm.models.layers.quantization.base import QuantizationConfig, QuantParams
from pagedllm.models.layers.quantization.reference import dequantize_weight


class Method(QuantizationConfig):
    name = "test"

    def __init__(self, bits: int, group_size: int, g_idx: bool = False) -> None:
        self.bits, self.group_size, self.has_g_idx = bits, group_size, g_idx


class Layer(nn.Module):
    """A quantized linear as LinearBase builds it (one rank)."""

    splits_input = False

    def __init__(self, out: int, inp: int, method: Method, dtype: torch.dtype, sym: bool,
                 seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ctx = types.SimpleNamespace(tp=types.SimpleNamespace(size=1, rank=0),
                                         device=torch.device("cpu"), dtype=dtype)
        levels = 1 << method.bits
        self.weight = nn.Parameter(torch.randint(0, levels, (out, inp), generator=gen)
                                   .to(torch.uint8), requires_grad=False)
        self.bias = None
        self.quant = QuantParams(self, inp, out, method)
        self.quant.scale.data = torch.rand(self.quant.scale.shape, generator=gen) * 0.01 + 1e-3
        if sym:
            self.quant.zero.data.fill_(levels // 2)
        else:
            self.quant.zero.data = torch.randint(0, levels, self.quant.scale.shape,
                                                 generator=gen).float()
        if method.has_g_idx:
            self.quant.g_idx.data = torch.randperm(inp, generator=gen).to(torch.int32) \
                // method.group_size


CASES = {  # name -> (bits, group_size, sym, g_idx, expected route)
    "int8-channel-sym": (8, 0, True, False, "int8"),
    "int4-g32-asym": (4, 32, False, False, "int4"),
    "int4-g128-sym": (4, 128, True, False, "int4"),
    "int4-g64-asym": (4, 64, False, False, "int4"),
    "int4-g256-asym": (4, 256, False, False, "int4"),
    "int8-g32-sym": (8, 32, True, False, "int8_grouped"),  # always dequantize + dense GEMM
    "int8-g128-sym": (8, 128, True, False, "int8_grouped"),
    "int8-g32-asym": (8, 32, False, False, None),
    "int8-channel-asym": (8, 0, False, False, None),
    "int4-g32-act-order": (4, 32, True, True, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [1, 7, quant_ops.DEQUANT_MIN_ROWS, 40])
def test_matches_float64_dequantized(case: str, dtype: torch.dtype, rows: int) -> None:
    """Both INT8 routes: the weight-only kernel below DEQUANT_MIN_ROWS, dequantize + GEMM
    from it."""
    bits, gs, sym, g_idx, route = CASES[case]
    layer = Layer(128, 256, Method(bits, gs, g_idx), dtype, sym)
    w64 = dequantize_weight(layer, torch.float64)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_quant_route == route
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = quant_ops.quant_linear(x, layer)
    assert y.dtype == dtype and y.shape == (rows, 128)
    ref = x.double() @ w64.t()
    # float32: accumulation-order noise; bfloat16: scales/offsets and the output in bf16
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("out", [64, 96, 192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantized_weight_is_exact(out: int, dtype: torch.dtype, gs: int) -> None:
    """Through the dequantize route (out a multiple of torch's packed block: 64 on AVX-512, 32
    on AVX2) the weight is torch's INT4 formula (q - 8) * scale + offset in float32 with scale
    and offset in dtype, rounded once to dtype: I @ W^T returns it bit for bit. Other outs keep
    torch's kernel (to rounding)."""
    layer = Layer(out, 256, Method(4, gs), dtype, sym=False, seed=out + gs)
    codes = layer.weight.data.float()  # [out, in] 0..15
    w64 = dequantize_weight(layer, torch.float64)
    quant_ops.quant_linear_prepare(layer)
    sz = layer.cpu_int4_scales_zeros.float()  # [in / gs, out, 2]
    scale = sz[..., 0].t().repeat_interleave(gs, dim=1)  # [out, in]
    offset = sz[..., 1].t().repeat_interleave(gs, dim=1)
    expected = ((codes - 8) * scale + offset).to(dtype)
    eye = torch.eye(256, dtype=dtype)  # 256 rows >= DEQUANT_MIN_ROWS
    y = quant_ops.quant_linear(eye, layer).t()
    block = quant_ops.int4pack_block_n()
    assert block in (32, 64), f"torch's int4 packed layout is unknown here (block {block})"
    if out % block == 0:
        assert quant_ops._cpu_kernels() is not False, "the csrc/cpu kernels did not build"
        assert torch.equal(y, expected)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), w64, rtol=tol, atol=tol * w64.abs().max().item())


def test_int4_packing_drops_the_codes() -> None:
    """After packing, the 4-bit weight takes half a byte per value (the INT4 memory claim)."""
    layer = Layer(128, 256, Method(4, 32), torch.bfloat16, sym=True)
    quant_ops.quant_linear_prepare(layer)
    assert layer.weight.numel() == 0
    assert layer.cpu_int4_weight.numel() * layer.cpu_int4_weight.element_size() == 128 * 256 // 2


def test_env_switch_keeps_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant_ops.QUANT_KERNELS_ENV, "0")
    layer = Layer(32, 64, Method(8, 0), torch.float32, sym=True)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_quant_route is None and layer.weight.numel() == 32 * 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threshold", ["1", "1000000"])
def test_int8_routes_agree_with_each_other(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                           threshold: str) -> None:
    """The same rows through the weight-only kernel (huge threshold) and the dequantize route
    (threshold 1) both match the float64 reference, and the scratch holds one layer's weight."""
    monkeypatch.setenv(quant_ops.DEQUANT_ROWS_ENV, threshold)
    layer = Layer(80, 192, Method(8, 0), dtype, sym=True, seed=3)
    w64 = dequantize_weight(layer, torch.float64)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_dequant_min_rows == int(threshold)
    x = torch.randn(16, 192, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = quant_ops.scratch_bytes()
    y = quant_ops.quant_linear(x, layer)
    ref = x.double() @ w64.t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if threshold == "1":
        assert quant_ops.scratch_bytes() >= 80 * 192 * torch.finfo(dtype).bits // 8
    else:
        assert quant_ops.scratch_bytes() == before


def test_scratch_is_reused_across_layers() -> None:
    """Layers of different sizes share one buffer per dtype, sized to the largest."""
    layers = [Layer(o, i, Method(8, 32), torch.float32, sym=True, seed=o) for o, i in
              ((64, 128), (160, 256), (32, 64))]
    for layer in layers:
        quant_ops.quant_linear_prepare(layer)
        quant_ops.quant_linear(torch.randn(3, layer.quant.scale.shape[1] * 32), layer)
    assert quant_ops.scratch_bytes() >= 160 * 256 * 4
    assert quant_ops.scratch_bytes() <= 160 * 256 * 4 + 4 * 1024 * 1024  # other tests' bf16


@pytest.mark.parametrize("value", ["0", "many"])
def test_bad_dequant_rows_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(quant_ops.DEQUANT_ROWS_ENV, value)
    layer = Layer(32, 64, Method(8, 0), torch.float32, sym=True)
    with pytest.raises(ValueError, match=quant_ops.DEQUANT_ROWS_ENV):
        quant_ops.quant_linear_prepare(layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[4] is not None])
def test_dequantize_route_within_conformance_bound(case: str, dtype: torch.dtype) -> None:
    """At 64 rows (the dequantize routes) the error stays inside pagedllm/testing's quant_linear
    bound: float32 accumulation plus one rounding to the dtype per output."""
    from pagedllm.testing.harness import tolerance

    bits, gs, sym, g_idx, _ = CASES[case]
    layer = Layer(128, 256, Method(bits, gs, g_idx), dtype, sym, seed=5)
    w64 = dequantize_weight(layer, torch.float64)
    quant_ops.quant_linear_prepare(layer)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = quant_ops.quant_linear(x, layer).double()
    ref = x.double() @ w64.t()
    mag = x.double().abs() @ w64.abs().t()
    tol = tolerance("float32" if dtype == torch.float32 else "bfloat16")
    bound = tol["rtol"] * 4 * ref.abs() + 64 * 2.0 ** -23 * mag + tol["atol"]
    assert ((got - ref).abs() <= bound).all(), f"max |error| {(got - ref).abs().max():.3g}"
