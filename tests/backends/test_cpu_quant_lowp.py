"""The cpu backend's INT8 compute mode (lowp int8: backends/cpu/quant_lowp.py): the oneDNN int8
product against float64 arithmetic on the same quantized operands, the total error against the
float64 dequantized reference within the activation-rounding bound, the csrc/cpu passes
bit-identical to their torch twins, and the mode's switch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu import quant_lowp, quant_ops
from pagedllm.models.layers.quantization.reference import dequantize_weight
from pagedllm.models.layers.quantization.synthetic import LAYOUTS, SyntheticLinear

INT8_CHANNEL = LAYOUTS["gptq"]["int8-channel-sym"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not quant_lowp.available(),
                                reason="torch's oneDNN int8 linear is not exact on this CPU")


def lowp_layer(monkeypatch: pytest.MonkeyPatch, out: int, inp: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[SyntheticLinear, torch.Tensor]:
    """A GPTQ INT8 per-channel linear prepared in lowp int8 mode, and its float64 weight."""
    monkeypatch.setenv(quant_ops.LOWP_MODE_ENV, "int8")
    layer = SyntheticLinear(INT8_CHANNEL, out, inp, dtype, torch.device("cpu"), seed=seed)
    w64 = dequantize_weight(layer, torch.float64)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_quant_route == "int8_lowp" and layer.act_quant == quant_lowp.ACT_QUANT
    return layer, w64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_product_is_exact(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                               rows: int) -> None:
    """y = s_x * (q_x @ q_w^T) * s_w up to float32 rounding of the sums and one rounding to the
    dtype: the GEMM itself loses nothing (int32 accumulation; K=1000 is not a multiple of the
    kernels' 4/16/64-column blocks)."""
    layer, w64 = lowp_layer(monkeypatch, 80, 1000, dtype)
    x = (torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    y = quant_ops.quant_linear(x, layer)
    assert y.dtype == dtype and y.shape == (rows, 80)
    q, s_x = quant_lowp.quantize_per_token(x)
    exact = ((q.double() - 128) * s_x.double()) @ w64.t()  # float64 on the rounded activations
    eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    mag = ((q.double() - 128).abs() * s_x.double()) @ w64.abs().t()
    bound = eps * exact.abs() + 2.0 ** -22 * mag + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_activation_rounding(monkeypatch: pytest.MonkeyPatch,
                                          dtype: torch.dtype) -> None:
    """Against the float64 dequantized reference, the error is at most half an int8 step of the
    token's range per product, s_x / 2 * sum_k |w[o, k]| (plus the output rounding), and it is
    not zero (the mode is lossy: the bound above is what the conformance suite allows)."""
    layer, w64 = lowp_layer(monkeypatch, 96, 256, dtype, seed=3)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(7)).to(dtype)
    ref = x.double() @ w64.t()
    y = quant_ops.quant_linear(x, layer).double()
    s_x = x.double().abs().amax(dim=-1, keepdim=True) / 127
    eps = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    bound = s_x / 2 * w64.abs().sum(dim=1) + eps * ref.abs() * 2 + 1e-12
    err = (y - ref).abs()
    assert (err <= bound).all()
    assert err.max() > 2 ** -10 * ref.abs().max()


def test_zero_rows_and_empty_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, _ = lowp_layer(monkeypatch, 32, 64, torch.bfloat16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert torch.equal(quant_ops.quant_linear(x, layer), torch.zeros(3, 32, dtype=torch.bfloat16))
    assert quant_ops.quant_linear(x[:0], layer).shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernels_match_torch_passes(dtype: torch.dtype) -> None:
    """quantize_per_token and scale_rows of csrc/cpu/quant_lowp_cpu.cpp are bit-identical to the
    torch functions (vector body and scalar tail: 37 columns; an all-zero row; ties at .5)."""
    from pagedllm.backends.cpu.kernels import load_cpu_kernels

    try:
        kernels = load_cpu_kernels()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 37, generator=gen) * 50).to(dtype)
    x[2] = 0
    x[3, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # amax 127 -> scale 1: ties to even
    q, s = kernels.quantize_per_token(x)
    q_ref, s_ref = quant_lowp.quantize_per_token(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    assert q[3, :4].tolist() == [255, 128, 130, 126]
    y = torch.randn(6, 21, generator=gen) * 1e3
    assert torch.equal(kernels.scale_rows(y.clone(), s, dtype),
                       quant_lowp.scale_rows(y.clone(), s, dtype))
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.scale_rows(y, s[:3], dtype)


def test_mode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: weight-only (torch's int8 kernel); a bad mode names the variable and choices."""
    monkeypatch.delenv(quant_ops.LOWP_MODE_ENV, raising=False)
    layer = SyntheticLinear(INT8_CHANNEL, 32, 64, torch.bfloat16, torch.device("cpu"), seed=0)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_quant_route == "int8" and not hasattr(layer, "act_quant")
    monkeypatch.setenv(quant_ops.LOWP_MODE_ENV, "int4")
    layer = SyntheticLinear(INT8_CHANNEL, 32, 64, torch.bfloat16, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_QUANT_LOWP_MODE='int4'.*none, int8"):
        quant_ops.quant_linear_prepare(layer)


def test_other_layouts_ignore_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only per-channel symmetric INT8 computes in INT8; INT4 keeps its weight-only kernel."""
    monkeypatch.setenv(quant_ops.LOWP_MODE_ENV, "int8")
    layer = SyntheticLinear(LAYOUTS["gptq"]["int4-g32-asym"], 32, 64, torch.bfloat16,
                            torch.device("cpu"), seed=0)
    quant_ops.quant_linear_prepare(layer)
    assert layer.cpu_quant_route == "int4" and not hasattr(layer, "act_quant")


def test_conformance_quant_linear_in_lowp_mode() -> None:
    """The conformance suite's quantized-linear check (pagedllm/testing/test_quant_linear.py)
    passes for the cpu backend with the mode on, under its documented int8-activation bound."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               **{quant_ops.LOWP_MODE_ENV: "int8"})
    env.pop("PAGEDLLM_TEST_DEVICE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--pyargs", "pagedllm.testing.test_quant_linear", "--device", "cpu",
                           "-k", "int8-channel-sym"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout.split("\n")[-2]
