"""Host/device mixing in the quantized-linear code, caught without a GPU.

Every checkpoint format is loaded, and every layer re-laid out for each cuda route its layout
allows, with the model on the ``meta`` device: a constant made on the host (``torch.arange``
without ``device=``) meets a meta tensor and raises "Tensor on device cpu is not on the expected
device meta", as it raises "found at least two devices, cuda:0 and cpu" on a GPU (the H100 run
of issue 39 found every int4 format failing so). The FP8 and reference forwards run on meta too.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig

from pagedllm.backends.cuda import quant_ops as cuda_quant
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.models.layers.linear import LayerContext, LinearBase
from pagedllm.models.layers.ops import Ops
from pagedllm.models.layers.quantization.synthetic import LAYOUTS, SyntheticLinear
from pagedllm.models.loader import load_model

META = torch.device("meta")


def routes(layer: Any) -> list[str]:
    """The cuda routes this layer's layout allows (the hardware decides among them)."""
    allowed = ["reference"]
    if cuda_quant.fp8_layout_ok(layer):
        allowed.append("fp8")
    if cuda_quant.int4_layout_ok(layer):
        allowed.append("int4")
    return allowed


def run_route(layer: Any, route: str) -> None:
    """Re-lays ``layer`` out for ``route`` and runs its forward where no kernel is needed."""
    out_features, in_features = layer.weight.shape
    cuda_quant.prepare_route(layer, route)
    if route == "int4":  # the kernel itself needs a GPU; its packed operands must be on meta
        assert all(t.device == META for t in layer.cuda_int4[:3])
        return
    x = torch.empty(5, in_features, device=META, dtype=layer.ctx.dtype)
    y = cuda_quant.quant_linear(x, layer)
    assert y.device == META and tuple(y.shape) == (5, out_features)


CASES = [(m, n) for m, layouts in LAYOUTS.items() for n in layouts]


@pytest.mark.parametrize("method, layout", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_synthetic_layouts_on_meta(method: str, layout: str) -> None:
    def make() -> SyntheticLinear:
        return SyntheticLinear(LAYOUTS[method][layout], 96, 256, torch.bfloat16, META, seed=0)

    for route in routes(make()):
        run_route(make(), route)


def _checkpoint(kind: str, float_path: str, dst: str) -> str:
    import quant_writers as qw

    if kind.startswith("gptq"):
        bits, gs, sym, desc_act = {"gptq-4bit": (4, 32, True, False),
                                   "gptq-4bit-desc_act": (4, 32, False, True),
                                   "gptq-8bit-channel": (8, -1, True, False)}[kind]
        return qw.gptq_checkpoint(float_path, dst, bits, gs, sym, desc_act)[0]
    if kind == "awq":
        return qw.awq_checkpoint(float_path, dst, 32)[0]
    if kind == "fp8-online":
        return float_path
    return qw.compressed_tensors_checkpoint(float_path, dst, kind.split(":")[1])


# format -> the cuda routes its layers take on a GPU with the kernels (a test of the layout
# predicates too: a format falling back to the reference by mistake fails here)
FORMATS = {"gptq-4bit": {"int4"}, "gptq-4bit-desc_act": set(), "gptq-8bit-channel": set(),
           "awq": {"int4"}, "fp8-online": {"fp8"}, "ct:W4A16": {"int4"},
           "ct:W4A16_ASYM": {"int4"}, "ct:W8A16": set(), "ct:FP8_DYNAMIC": {"fp8"}}


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from quant_writers import float_checkpoint

    return float_checkpoint(str(tmp_path_factory.mktemp("placement-float")),
                            hidden_size=64, intermediate_size=128)


@pytest.mark.parametrize("kind", FORMATS)
def test_checkpoints_load_and_relayout_on_meta(kind: str, float_path: str, tmp_path) -> None:
    if kind.startswith("ct:"):
        pytest.importorskip("compressed_tensors")
    path = _checkpoint(kind, float_path, str(tmp_path / "q"))
    hf_config = AutoConfig.from_pretrained(path)
    cfg = ModelConfig(model=path, tokenizer=path, dtype="bfloat16", max_model_len=64,
                      hf_config=hf_config, quantization="fp8" if kind == "fp8-online" else None)

    def load() -> torch.nn.Module:
        from pagedllm.backends.cpu.attention import TorchPagedAttention

        ctx = LayerContext(ops=Ops(), tp=TPGroup(), dtype=torch.bfloat16, device=META,
                           attn_cls=TorchPagedAttention)
        return load_model(cfg, ctx)

    seen = set()
    for route in ("reference", "fp8", "int4"):  # a fresh model per route: routes re-lay out
        layers = [m for m in load().modules() if isinstance(m, LinearBase) and m.quant is not None]
        assert layers, f"{kind}: no quantized linear was loaded"
        for layer in layers:
            if route in routes(layer):
                run_route(layer, route)
                seen.add(route)
    assert seen == {"reference"} | FORMATS[kind], f"{kind}: routes {sorted(seen)}"
