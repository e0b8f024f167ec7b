"""The AWQ writer of quant_writers.py (and so pagedllm's AWQ reader, which the model tests hold
to it) against AutoAWQ's own packing code: ``WQLinear_GEMM.from_linear`` packs the same qweight
and qzeros words, and ``dequantize_gemm`` unpacks them to the weights pagedllm computes with.

autoawq does not install on the CPU test machine (triton/CUDA stack, older transformers); where
it is importable (``pip install --no-deps autoawq accelerate``) this runs its modules directly,
without its package __init__ (which imports its whole model zoo)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from quant_writers import awq_pack, quantize_groups


def autoawq(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, types.ModuleType]:
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, sub in (("awq", ""), ("awq.modules", "modules"),
                      ("awq.modules.linear", os.path.join("modules", "linear")),
                      ("awq.utils", "utils")):
        stub = types.ModuleType(name)
        stub.__path__ = [os.path.join(root, sub)]
        monkeypatch.setitem(sys.modules, name, stub)
    try:
        return (importlib.import_module("awq.modules.linear.gemm"),
                importlib.import_module("awq.utils.packing_utils"))
    except ImportError as exc:
        pytest.skip(f"autoawq's modules do not import here: {exc}")


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_packing_matches_autoawq(group_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gemm, packing = autoawq(monkeypatch)
    torch.manual_seed(group_size)
    out, inp = 64, 256
    w = torch.randn(out, inp) * 0.05
    g_idx = torch.arange(inp) // group_size
    codes, scales, zeros = quantize_groups(w, 4, group_size, False, g_idx)
    deq = (codes.float() - zeros[:, g_idx]) * scales[:, g_idx]
    linear = torch.nn.Linear(inp, out, bias=False)
    linear.weight.data = deq
    ref = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales.t().half(),
                                         zeros=zeros.t().to(torch.int32))
    qweight, qzeros, half_scales = awq_pack(codes, zeros, scales)
    assert torch.equal(ref.qweight, qweight)
    assert torch.equal(ref.qzeros, qzeros)
    assert torch.equal(ref.scales, half_scales)
    # AutoAWQ's unpacking of our words gives the weights pagedllm dequantizes to
    from pagedllm.models.layers.quantization.awq import AWQConfig
    from pagedllm.models.layers.quantization.reference import dequantize_weight

    tensors = dict(AWQConfig(group_size)._module("m", {"qweight": qweight, "qzeros": qzeros,
                                                       "scales": half_scales}))
    layer = types.SimpleNamespace(weight=tensors["m.weight"], quant=types.SimpleNamespace(
        scale=tensors["m.quant.scale"], zero=tensors["m.quant.zero"], g_idx=None,
        group_size=group_size))
    ours = dequantize_weight(layer)
    theirs = packing.dequantize_gemm(qweight, qzeros, half_scales, 4, group_size).float().t()
    assert torch.allclose(ours, theirs, rtol=1e-3, atol=1e-4)
    assert torch.allclose(ours, deq, rtol=0, atol=0)
