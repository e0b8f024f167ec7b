"""Quantized linears (``quant_linear`` as the backend registers it) against a float64
dequantized reference, for every method the backend declares in ``Capabilities.quantizations``
and every layout that method's checkpoints produce (models/layers/quantization/synthetic.py).

Tolerance: float32 accumulation plus one rounding to the dtype (the model-ops tolerance), and
for FP8 activations one e4m3 step (2^-4 relative) per product, since a kernel may round a value
near a boundary the other way than the reference's per-token quantization. The dequantized
weight may be rounded once to the activation dtype (what a dequantize-then-GEMM kernel does:
tensor-core and AMX/oneDNN routes multiply in that dtype), half an ulp of it per product; 64 rows
reach such routes (the cpu backend switches from 12-32 rows). A backend that
quantizes activations to int8 per token (it sets ``layer.act_quant = "int8_per_token"``) is
allowed half an int8 step of the token's range per product; one that quantizes activations to
e4m3 per token (``layer.act_quant = "fp8_per_token"``, the cuda FP8 route) is compared with the
reference on the same quantized activations, with the e4m3 step above."""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN
from pagedllm.models.layers.quantization.synthetic import LAYOUTS, SyntheticLinear
from pagedllm.reference.ops import Ops
from pagedllm.reference.quant import dequantize_weight, fp8_per_token
from pagedllm.testing.harness import tolerance, torch_dtype

AREA = "quantized linears"
CASES = [(method, name) for method, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("method, layout", CASES, ids=[f"{m}-{n}" for m, n in CASES])
@pytest.mark.parametrize("rows", [1, 19, 64])
def test_quant_linear(method: str, layout: str, rows: int, conformance_backend: Backend,
                      conformance_dtype: str, conformance_device: torch.device,
                      conformance_rng: torch.Generator) -> None:
    if method not in conformance_backend.capabilities.quantizations:
        pytest.skip(f"{method} not declared by {conformance_backend.name}")
    dt, dev = torch_dtype(conformance_dtype), conformance_device
    spec = LAYOUTS[method][layout]
    layer = SyntheticLinear(spec, 96, 256, dt, dev, seed=rows)
    w64 = dequantize_weight(layer, torch.float64).cpu()
    ops = Ops()
    conformance_backend.register_ops(ops)
    ops.quant_linear_prepare(layer)
    x = torch.randn(rows, 256, generator=conformance_rng).to(dt)
    got = ops.quant_linear(x.to(dev), layer)
    assert got.dtype == dt and got.shape == (rows, 96), f"{got.dtype} {tuple(got.shape)}"
    got = got.cpu().double()
    # W8A8: the checkpoint's scheme, or a backend that quantizes activations itself (it sets
    # ``layer.act_quant = "fp8_per_token"``, as vLLM's dynamic fp8 linear does)
    fp8_acts = ACT_FP8_PER_TOKEN in (spec[-1], getattr(layer, "act_quant", None))
    xr = fp8_per_token(x.float()).double() if fp8_acts else x.double()
    ref = xr @ w64.t()
    mag = xr.abs() @ w64.abs().t()
    tol = tolerance(conformance_dtype)
    bound = tol["rtol"] * 4 * ref.abs() + 64 * 2.0 ** -23 * mag + tol["atol"]
    bound = bound + torch.finfo(dt).eps / 2 * mag  # the weight rounded once to the dtype
    if fp8_acts:
        bound = bound + 2.0 ** -4 * mag
    if getattr(layer, "act_quant", None) == "int8_per_token":
        # a backend computing in INT8 (the cpu lowp int8 mode): each activation is rounded to
        # its token's int8 grid, |x - x_q| <= amax_t / 254
        step = x.double().abs().amax(dim=-1, keepdim=True) / 254
        bound = bound + step * w64.abs().sum(dim=1)
    err = (got - ref).abs()
    assert torch.isfinite(got).all(), "non-finite output"
    assert (err <= bound).all(), f"max |error| {err.max().item():.3g} vs float64 reference"
