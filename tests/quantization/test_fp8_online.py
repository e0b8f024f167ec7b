"""quantization="fp8" on a float checkpoint: per-channel e4m3 weights at load; greedy tokens
equal transformers' on the same weights rounded through e4m3 (float32)."""
from __future__ import annotations

import pytest

from quant_writers import assert_matches, float_checkpoint, fp8_dequant_checkpoint


def test_fp8_on_the_fly_matches_rounded_model(tmp_path) -> None:
    src = float_checkpoint(str(tmp_path / "float"))
    twin = fp8_dequant_checkpoint(src, str(tmp_path / "fp8-twin"))
    assert_matches(src, twin, quantization="fp8")


def test_fp8_weights_are_one_byte(tmp_path) -> None:
    import torch

    from pagedllm import LLM

    src = float_checkpoint(str(tmp_path / "float"))
    llm = LLM(src, device="cpu", dtype="float32", quantization="fp8")
    try:
        layer = llm.llm_engine.executor.worker.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.quant.scale.shape == (layer.weight.shape[0], 1)
    finally:
        llm.llm_engine.shutdown()
