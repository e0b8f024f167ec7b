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

from typing import Any

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.quantization import ACT_FP8_PER_TOKEN
from pagedllm.models.layers.quantization.synthetic import LAYOUTS, SyntheticLinear
from pagedllm.reference.ops import Ops
from pagedllm.reference.quant import dequantize_weight, fp8_per_token
from pagedllm.testing.coverage import note
from pagedllm.testing.harness import tolerance, torch_dtype
from pagedllm.testing.space import Space

AREA = "quantized linears"
CASES = [(method, name) for method, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("method, layout", CASES, ids=[f"{m}-{n}" for m, n in CASES])
@pytest.mark.parametrize("rows", [1, 19, 64])
def test_quant_linear(method: str, layout: str, rows: int, conformance_backend: Backend,
                      conformance_dtype: str, conformance_device: torch.device,
                      conformance_rng: torch.Generator) -> None:
    if method not in conformance_backend.capabilities.quantizations:
        pytest.skip(f"{method} not declared by {conformance_backend.name}")
    check_quant_linear(conformance_backend, method, layout, conformance_dtype, rows, 96, 256,
                       False, conformance_device, conformance_rng, seed=rows)


def check_quant_linear(backend: Backend, method: str, layout: str, dtype: str, rows: int,
                       out: int, inp: int, bias: bool, dev: torch.device,
                       rng: torch.Generator, seed: int) -> None:
    """One quantized linear [rows, inp] -> [rows, out] (with a bias when asked) through the
    backend's quant_linear_prepare / quant_linear, against the float64 dequantized reference."""
    dt = torch_dtype(dtype)
    spec = LAYOUTS[method][layout]
    layer = SyntheticLinear(spec, out, inp, dt, dev, seed=seed)
    b64 = None
    if bias:
        b = torch.randn(out, generator=rng).to(dt)
        layer.bias = torch.nn.Parameter(b.to(dev), requires_grad=False)
        b64 = b.double()
    w64 = dequantize_weight(layer, torch.float64).cpu()
    ops = Ops()
    backend.register_ops(ops)
    ops.quant_linear_prepare(layer)
    x = torch.randn(rows, inp, generator=rng).to(dt)
    got = ops.quant_linear(x.to(dev), layer)
    assert got.dtype == dt and got.shape == (rows, out), f"{got.dtype} {tuple(got.shape)}"
    got = got.cpu().double()
    # W8A8: the checkpoint's scheme, or a backend that quantizes activations itself (it sets
    # ``layer.act_quant = "fp8_per_token"``, as vLLM's dynamic fp8 linear does)
    fp8_acts = ACT_FP8_PER_TOKEN in (spec[-1], getattr(layer, "act_quant", None))
    xr = fp8_per_token(x.float()).double() if fp8_acts else x.double()
    ref = xr @ w64.t() + (0 if b64 is None else b64)
    mag = xr.abs() @ w64.abs().t() + (0 if b64 is None else b64.abs())
    tol = tolerance(dtype)
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
    assert (err <= bound).all(), (f"{method} {layout}, {rows} x {inp} -> {out}, bias {bias}: "
                                  f"max |error| {err.max().item():.3g} vs float64 reference")
    note(rows=rows, out_features=out, in_features=inp, bias=bias, layout=layout)


# --- the declared space (issue 41): every declared layout at more row counts, an odd output
# width (1,032 = 129 x 8: no multiple of 16, 32 or 64), a wider input and the bias --------------
def _quant_space(caps: Any, *_: Any) -> Space:
    layouts = [f"{m}:{n}" for m, n in CASES if m in caps.quantizations] or ["none"]
    return Space({"dtype": list(caps.dtypes), "layout": layouts, "rows": [1, 37, 263],
                  "shape": [(96, 256), (1032, 384)], "bias": [False, True]})


SPACES = {"test_quant_linear_sweep": _quant_space}
CAPABILITY_OF = {"test_quant_linear_sweep": "quantized linears (sweep)"}


def test_quant_linear_sweep(conformance_backend: Backend, sweep_case: dict,
                            conformance_device: torch.device) -> None:
    if sweep_case["layout"] == "none":
        pytest.skip(f"{conformance_backend.name} declares no quantization")
    method, layout = sweep_case["layout"].split(":")
    out, inp = sweep_case["shape"]
    rng = torch.Generator().manual_seed(sweep_case["rows"] * 7 + out)
    check_quant_linear(conformance_backend, method, layout, sweep_case["dtype"],
                       sweep_case["rows"], out, inp, sweep_case["bias"], conformance_device,
                       rng, seed=sweep_case["rows"] + out)
