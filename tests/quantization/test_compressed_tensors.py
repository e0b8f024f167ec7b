"""compressed-tensors checkpoints written by the compressed-tensors library: pagedllm's greedy
tokens equal transformers' on the same checkpoint (transformers decompresses it on CPU), and
the chosen tokens' logprobs agree."""
from __future__ import annotations

import pytest

pytest.importorskip("compressed_tensors")

from quant_writers import assert_matches, compressed_tensors_checkpoint, float_checkpoint  # noqa: E402


def fp8_per_tensor_dynamic():
    """FP8 weights with one scale per tensor, dynamic per-token FP8 activations."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True,
                                 dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token",
                                           symmetric=True, dynamic=True))


SCHEMES = {
    "W4A16": lambda: "W4A16",  # int4 groups of 32, symmetric, pack-quantized
    "W4A16_ASYM": lambda: "W4A16_ASYM",  # int4 groups of 32 with zero points
    "W8A16": lambda: "W8A16",  # int8 groups of 32, pack-quantized
    "FP8_DYNAMIC": lambda: "FP8_DYNAMIC",  # per-channel FP8 weights, per-token FP8 activations
    "FP8_TENSOR_DYNAMIC": fp8_per_tensor_dynamic,
}


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return float_checkpoint(str(tmp_path_factory.mktemp("ct-float")))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_matches_transformers(scheme: str, float_path: str, tmp_path) -> None:
    path = compressed_tensors_checkpoint(float_path, str(tmp_path / scheme), SCHEMES[scheme]())
    # transformers 5.25 cannot load packed zero points (it sizes them [out, G], the library
    # writes [out * bits / 32, G]); the asymmetric scheme runs against the float32 twin
    # FP8 activations: a value a float32 ulp from an e4m3 rounding boundary (the attention's
    # summation order differs from transformers') rounds to the neighbour, a 1/16 relative step
    # in one activation, so logprobs agree to ~1e-2 there and to float32 noise elsewhere
    atol = 2e-2 if "FP8" in scheme else 1e-3
    assert_matches(path, path + "-dequant" if scheme == "W4A16_ASYM" else path, atol=atol)


def test_dequantized_twin_matches_transformers(float_path: str, tmp_path) -> None:
    """The twin (the library's fake_quantize) is what transformers computes from the
    checkpoint: this ties the twin used above to the checkpoint's own meaning."""
    path = compressed_tensors_checkpoint(float_path, str(tmp_path / "w4"), "W4A16")
    assert_matches(path + "-dequant", path)


def test_quantized_linear_holds_codes(float_path: str, tmp_path) -> None:
    """The engine keeps 4-bit codes and group scales, not float weights."""
    import torch

    from pagedllm import LLM

    path = compressed_tensors_checkpoint(float_path, str(tmp_path / "w4"), "W4A16")
    llm = LLM(path, device="cpu", dtype="float32")
    try:
        model = llm.llm_engine.executor.worker.model
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.quant is not None and qkv.weight.dtype in (torch.uint8, torch.int8)
        assert qkv.quant.scale.shape[1] == 64 // 32
    finally:
        llm.llm_engine.shutdown()
