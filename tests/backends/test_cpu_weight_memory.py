"""The cpu backend's packed linears are the only copy of their weights (ops.py's module doc): the
linear op computes without the plain weight (which would be NaN or raise if read), a released
weight fails loudly, tied and shared weights stay, PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS=1 keeps
them all; and a model loaded by LLM holds ~1x its checkpoint (2x for bf16 on the float32 route)
while generating transformers' greedy tokens."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from family_utils import hf_greedy, prompts  # noqa: E402
from test_hf_equality import MAX_TOKENS  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.backends.cpu import ops  # noqa: E402
from pagedllm.models.layers.embedding import ParallelLMHead  # noqa: E402
from pagedllm.models.layers.linear import LinearBase  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _layer(out: int, inp: int, dtype: torch.dtype, bias: bool,
           seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor | None]:
    """A linear layer and the reference's own copies of its weight [out, inp] and bias."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inp, generator=gen) / inp ** 0.5).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    layer = nn.Module()
    layer.weight = nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = nn.Parameter(b.clone(), requires_grad=False) if bias else None
    return layer, w, b


def _inputs(inp: int) -> list[torch.Tensor]:
    """2-D inputs around the packing hints, a 3-D one, and an empty one."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, inp, generator=gen) for shape in
            ((1,), (5,), (64,), (300,), (2, 3), (0,))]


def _check_outputs(layer: nn.Module, w: torch.Tensor, b: torch.Tensor | None,
                   in_dtypes: tuple[torch.dtype, ...]) -> None:
    """``linear`` on every input of ``_inputs`` in each of ``in_dtypes`` equals the float64
    reference (within float32's or, where the input or weight is bf16, bf16's rounding)."""
    for x32 in _inputs(w.shape[1]):
        for dtype in in_dtypes:
            tol = 1e-5 if dtype == w.dtype == torch.float32 else 2e-2
            x = x32.to(dtype)
            out = ops.linear(x, layer)
            ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
            assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape)
            assert not out.isnan().any(), (dtype, tuple(x.shape))
            if ref.numel():
                err = (out.double() - ref).norm() / ref.norm()
                assert err < tol, (dtype, tuple(x.shape), err)


@pytest.mark.parametrize("bias", [False, True])
def test_mkl_route_computes_from_the_packing_alone(route, bias: bool) -> None:
    """The plain weight torch's packed sgemm takes is a one-element NaN placeholder: any read of
    it (torch's fallback to F.linear at another row count) makes the output NaN."""
    route(fp32="mkl")
    if not ops.mkl_packed_linear_supported():
        pytest.skip("torch without MKL's packed sgemm")
    layer, w, b = _layer(48, 40, torch.float32, bias)
    ops.linear_prepare(layer)
    assert isinstance(layer.weight, ops.ReleasedWeight) and layer.mkl_weight is not None
    placeholder = layer.mkl_shape_weight
    assert placeholder.shape == w.shape and placeholder.stride() == (0, 0)
    assert placeholder.untyped_storage().nbytes() == 4 and placeholder.isnan().all()
    # float32 rows (2-D, 3-D, none) and bf16 rows (converted, the output converted back)
    _check_outputs(layer, w, b, (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("dtype,half", [(torch.float32, None), (torch.bfloat16, "native"),
                                        (torch.bfloat16, "float32")])
def test_onednn_routes_take_any_input_without_the_weight(route, dtype: torch.dtype,
                                                         half: str | None) -> None:
    """2-D, 3-D and empty inputs, in the layer's dtype and another one."""
    route(fp32="onednn", half=half)
    if not ops.onednn_linear_supported(torch.float32):
        pytest.skip("no oneDNN")
    layer, w, b = _layer(40, 56, dtype, bias=True)
    ops.linear_prepare(layer)
    assert isinstance(layer.weight, ops.ReleasedWeight)
    _check_outputs(layer, w, b, (torch.float32, torch.bfloat16))


def test_a_released_weight_keeps_its_metadata_and_fails_loudly(route) -> None:
    route()
    layer, w, _ = _layer(24, 16, torch.bfloat16, bias=False)
    ops.linear_prepare(layer)
    if not hasattr(layer, "packed_weight") and not hasattr(layer, "mkl_weight"):
        pytest.skip("nothing packed here (no oneDNN): the weight stays")
    weight = layer.weight
    assert isinstance(weight, ops.ReleasedWeight) and isinstance(weight, nn.Parameter)
    assert (weight.shape, weight.dtype, weight.device) == (w.shape, w.dtype, w.device)
    assert [p.shape for p in layer.parameters()] == [w.shape]
    assert next(layer.parameters()).dtype == torch.bfloat16
    match = r"weight of Module\[24, 16\] was released.*PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS=1"
    for read in (lambda: F.linear(torch.ones(2, 16, dtype=w.dtype), weight),
                 lambda: weight.float(), lambda: weight.sum(), lambda: weight.copy_(w),
                 lambda: F.embedding(torch.tensor([0]), weight)):
        with pytest.raises(RuntimeError, match=match):
            read()


def test_shared_weights_and_slices_stay(route) -> None:
    """A tied LM head's weight is the embedding's parameter, which the embedding reads: it stays;
    so does an expert's slice of a larger tensor (releasing it would free nothing)."""
    route()
    embedding = nn.Embedding(30, 16)
    head = nn.Module()
    head.weight = embedding.weight  # tied
    head.bias = None
    ops.linear_prepare(head)
    assert head.weight is embedding.weight and not isinstance(head.weight, ops.ReleasedWeight)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.allclose(ops.linear(x, head), x @ embedding.weight.T, atol=1e-5)
        embedding(torch.tensor([1, 2]))
    stacked = torch.randn(4, 24, 16)
    expert = SimpleNamespace(weight=stacked[1], bias=None)
    ops.linear_prepare(expert)
    assert not isinstance(expert.weight, ops.ReleasedWeight)
    assert torch.allclose(ops.linear(x, expert), x @ stacked[1].T, atol=1e-5)


def test_keep_unpacked_switch(route, monkeypatch: pytest.MonkeyPatch) -> None:
    route()
    monkeypatch.setenv(ops.KEEP_UNPACKED_ENV, "1")
    layer, w, _ = _layer(24, 16, torch.float32, bias=False)
    ops.linear_prepare(layer)
    assert not isinstance(layer.weight, ops.ReleasedWeight) and torch.equal(layer.weight, w)
    monkeypatch.setenv(ops.KEEP_UNPACKED_ENV, "maybe")
    layer, _, _ = _layer(24, 16, torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS='maybe' is invalid: "
                                         r"allowed values are 1, true, yes, on"):
        ops.linear_prepare(layer)


# --- a model loaded by LLM ---------------------------------------------------------------------

_PACKS = ("packed_weight", "packed_bias", "mkl_weight")


def _tensor_bytes(t: torch.Tensor, seen: set) -> int:
    """Bytes ``t`` holds, once per storage (oneDNN's packed tensors are opaque: their logical
    size, which the blocked layouts of these shapes do not pad)."""
    if t.is_mkldnn:
        key, size = ("mkldnn", id(t)), t.numel() * t.element_size()
    else:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
    if key in seen:
        return 0
    seen.add(key)
    return size


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters with storage plus the linears' packed copies."""
    seen: set = set()
    total = 0
    for module in model.modules():
        held = [p for p in module.parameters(recurse=False)
                if not isinstance(p, ops.ReleasedWeight)]
        held += [getattr(module, name) for name in _PACKS
                 if getattr(module, name, None) is not None]
        total += sum(_tensor_bytes(t, seen) for t in held)
    return total


def checkpoint_numels(path: str) -> tuple[int, int]:
    """(all, linear) element counts of the checkpoint's tensors (linear: 2-D, not an
    embedding)."""
    from safetensors import safe_open

    total = linear = 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    shape = f.get_slice(key).get_shape()
                    n = int(torch.Size(shape).numel())
                    total += n
                    linear += n if len(shape) == 2 and "embed" not in key else 0
    return total, linear


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _load(path: str, dtype: str) -> tuple[LLM, nn.Module]:
    llm = LLM(path, device="cpu", dtype=dtype, max_model_len=128)
    return llm, llm.llm_engine.executor.worker.model


@pytest.fixture(scope="module")
def qwen3(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("qwen3")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("fp32", ["onednn", "mkl"])
def test_float32_model_holds_its_checkpoint_once(qwen3, route, fp32: str) -> None:
    """Untied Qwen3 in float32: every linear's plain weight released, ~1x the checkpoint's bytes
    on oneDNN's route (MKL's packing has a large fixed size per matrix at these tiny shapes, so
    only the release is checked there), transformers' greedy tokens."""
    route(fp32=fp32)
    if fp32 == "mkl" and not ops.mkl_packed_linear_supported():
        pytest.skip("torch without MKL's packed sgemm")
    if not ops.onednn_linear_supported(torch.float32):
        pytest.skip("no oneDNN: nothing is packed")
    path, expected = qwen3
    llm, model = _load(path, "float32")
    try:
        linears = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
        assert linears and all(isinstance(m.weight, ops.ReleasedWeight) for m in linears)
        if fp32 == "onednn":
            numel, _ = checkpoint_numels(path)
            ratio = resident_weight_bytes(model) / (numel * 4)
            assert 0.98 < ratio < 1.05, ratio
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("half", ["native", "float32"])
def test_bf16_model_memory_and_tokens(qwen3, route, monkeypatch: pytest.MonkeyPatch,
                                      half: str) -> None:
    """bf16 Qwen3: ~1x the checkpoint's bf16 bytes natively, the linears twice over on the
    float32 route; the same greedy tokens as the engine keeping its unpacked weights."""
    route(half=half)
    if not ops.onednn_linear_supported(torch.float32):
        pytest.skip("no oneDNN: nothing is packed")
    compute = ops.half_compute_dtype(torch.bfloat16)
    path, _ = qwen3
    numel, linear = checkpoint_numels(path)
    llm, model = _load(path, "bfloat16")
    try:
        expected_bytes = 2 * numel + (compute.itemsize - 2) * linear
        released_bytes = resident_weight_bytes(model)
        assert 0.98 < released_bytes / expected_bytes < 1.05, (compute, released_bytes)
        released = _greedy(llm)
    finally:
        llm.llm_engine.shutdown()
    monkeypatch.setenv(ops.KEEP_UNPACKED_ENV, "1")
    llm, model = _load(path, "bfloat16")
    try:
        assert resident_weight_bytes(model) - released_bytes == 2 * linear  # the bf16 weights
        assert _greedy(llm) == released
    finally:
        llm.llm_engine.shutdown()


def test_tied_embeddings_stay_and_match_transformers(checkpoint_factory, route) -> None:
    """Qwen2 with tie_word_embeddings: the embedding keeps its table (the LM head's parameter),
    every other linear is released; the packed head is the one extra copy; transformers' greedy
    tokens."""
    route(fp32="onednn")
    if not ops.onednn_linear_supported(torch.float32):
        pytest.skip("no oneDNN: nothing is packed")
    path = checkpoint_factory("qwen2")
    expected = hf_greedy(path, prompts())
    llm, model = _load(path, "float32")
    try:
        assert model.lm_head.weight is model.embed_tokens.weight
        assert not isinstance(model.embed_tokens.weight, ops.ReleasedWeight)
        assert model.lm_head.packed_weight is not None
        others = [m for m in model.modules() if isinstance(m, LinearBase)]
        assert others and all(isinstance(m.weight, ops.ReleasedWeight) for m in others)
        numel, _ = checkpoint_numels(path)
        head = model.embed_tokens.weight.numel()
        ratio = resident_weight_bytes(model) / ((numel + head) * 4)
        assert 0.98 < ratio < 1.05, ratio
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()
