"""Gemma's layer ops on the cpu kernels (csrc/cpu/layer_ops_cpu.cpp): gemma_rms_norm (the (1 + w)
norm, scale applied in float32 and rounded once) and gelu_tanh_and_mul, against the torch
references of pagedllm/models/layers/ops.py, which are checked against transformers' own Gemma
norm and GELU-tanh; the backend's wiring. Skipped where the cpu kernels cannot be built."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers import ops as reference

HALF_DTYPES = [torch.bfloat16, torch.float16]


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between same-sign values of a and b."""
    return int((_bits(a).int() - _bits(b).int()).abs().max()) if a.numel() else 0


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    from pagedllm.backends.cpu.layer_ops import layer_ops

    return layer_ops(cpu_kernels)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_reference_gemma_rms_norm_is_transformers(dtype: torch.dtype) -> None:
    """The op's reference reproduces transformers' Gemma2RMSNorm bit for bit (the residual add
    in the model dtype before it, as the decoder layer does)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    res = torch.randn(7, 96, generator=gen).to(dtype)
    hf = Gemma2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=gen) * 0.5)
        want = hf(x + res)
    got, new_res = reference.gemma_rms_norm(x, hf.weight.detach(), 1e-6, res)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(new_res, x + res)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (9, 768), (33, 100)])
def test_gemma_rms_norm_half(ops, tokens: int, hidden: int, with_residual: bool,
                             dtype: torch.dtype) -> None:
    """bf16/fp16: the new residual bit for bit; the output is T(normed * (1 + w)) with one
    rounding, so only the float32 mean's last bit (summation order) can move it: at most one
    ulp of the dtype, on at most 0.2% of the elements. Rounding the normed value to the dtype
    before the scale (Llama's rms_norm) fails this."""
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = (torch.randn(tokens, hidden + 8, generator=gen)[:, :hidden] * 3).to(dtype)  # strided
    w = (torch.randn(hidden, generator=gen) * 0.5).to(dtype)
    res = torch.randn(tokens, hidden, generator=gen).to(dtype) if with_residual else None
    got, got_h = ops["gemma_rms_norm"](x, w, 1e-6, res)
    ref, ref_h = reference.gemma_rms_norm(x, w, 1e-6, res)
    assert got.dtype == dtype and torch.equal(_bits(got_h), _bits(ref_h))
    differ = got != ref
    assert differ.sum().item() <= max(1, got.numel() // 500)
    assert _ulps(got[differ], ref[differ]) <= 1


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_float32(ops, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 768, generator=gen) * 3
    w = torch.randn(768, generator=gen) * 0.5
    res = torch.randn(9, 768, generator=gen) if with_residual else None
    got, got_h = ops["gemma_rms_norm"](x, w, 1e-6, res)
    ref, ref_h = reference.gemma_rms_norm(x, w, 1e-6, res)
    assert torch.equal(got_h, ref_h)
    torch.testing.assert_close(got, ref, rtol=5e-7, atol=0)
    h = ref_h.double()
    exact = h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-7)


def test_reference_gelu_tanh_and_mul_is_transformers() -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(4, 2 * 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = ACT2FN["gelu_pytorch_tanh"](x[:, :40]) * x[:, 40:]
    assert torch.equal(_bits(reference.gelu_tanh_and_mul(x)), _bits(want))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 16), (5, 352), (64, 3072), (3, 27), (7, 100)])
def test_gelu_tanh_and_mul_half_within_an_ulp(ops, tokens: int, inter: int,
                                              dtype: torch.dtype) -> None:
    """The gate in float32 with a polynomial-exp tanh (widths 27 and 100: scalar tails), rounded
    to the dtype before the product: each value the reference's or one rounding step of the
    dtype from it (tiny gates near zero aside), and most values the reference's bits."""
    gen = torch.Generator().manual_seed(inter + 11)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 9.0, -9.0])
    got = ops["gelu_tanh_and_mul"](x)
    want = reference.gelu_tanh_and_mul(x)
    assert got.is_contiguous() and got.dtype == dtype
    ulp = torch.finfo(dtype).eps  # one rounding step relative to the value, twice (gate, product)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-4)
    differ = int((_bits(got) != _bits(want)).sum())
    # most values the reference's bits (two may differ in the 16 of the smallest case: the AVX2
    # build's tanh polynomial rounds a gate the other way more often than AVX-512's)
    assert differ <= max(2, got.numel() // 10), (differ, got.numel())
    # a wrong gate (SiLU's, or a missing 0.5) is far outside that
    wrong = (F.silu(x[:, :inter].float()).to(dtype) * x[:, inter:]).float()
    assert not torch.allclose(got.float(), wrong, rtol=2 * ulp, atol=1e-4)


@pytest.mark.parametrize("tokens,inter", [(1, 16), (5, 352), (64, 3072), (3, 27)])
def test_gelu_tanh_and_mul_float32(ops, cpu_kernels, tokens: int, inter: int) -> None:
    """float32: the op is the reference (bit for bit: torch's own build may fuse a product into
    an FMA, so the kernel's float32 path is only an ulp or two close, checked against float64)."""
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, 2 * inter, generator=gen) * 4
    assert torch.equal(ops["gelu_tanh_and_mul"](x), reference.gelu_tanh_and_mul(x))
    # |x| up to ~16: products up to ~250, a few float32 ulps of slack near the gate's zeros
    exact = F.gelu(x[:, :inter].double(), approximate="tanh") * x[:, inter:].double()
    torch.testing.assert_close(cpu_kernels.gelu_tanh_and_mul(x).double(), exact, rtol=1e-6,
                               atol=1e-5)


def test_argument_errors(ops, cpu_kernels) -> None:
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels.gelu_tanh_and_mul(torch.randn(3, 63))
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.gemma_rms_norm(x, torch.zeros(32), 1e-6, None)
    with pytest.raises(RuntimeError, match="residual must have the shape"):
        cpu_kernels.gemma_rms_norm(x, torch.zeros(64), 1e-6, x[:2])
    # mixed dtypes are not the kernels' case: the reference runs (type promotion)
    got, _ = ops["gemma_rms_norm"](x.bfloat16(), torch.zeros(64), 1e-6)
    want, _ = reference.gemma_rms_norm(x.bfloat16(), torch.zeros(64), 1e-6)
    assert torch.equal(got, want)


def test_cpu_backend_registers_the_gemma_ops(cpu_kernels) -> None:
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.layers.ops import Ops

    ops = Ops()
    CpuBackend().register_ops(ops)
    assert ops.gemma_rms_norm is not reference.gemma_rms_norm
    assert ops.gelu_tanh_and_mul is not reference.gelu_tanh_and_mul
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(ops.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))
