"""GPTQ (GPTQModel/AutoGPTQ v1 layout) and AWQ (AutoAWQ GEMM layout) checkpoints: greedy tokens
equal transformers' on the dequantized float32 twin, logprobs within float32 noise. On the cpu
backend the 4-bit cases without act order run its INT4 kernel, 8-bit per-channel symmetric its
INT8 kernel (backends/cpu/quant_ops.py), the rest the reference.

The checkpoints come from quant_writers.py (gptqmodel and autoawq cannot be installed on the
CPU test machine; see there)."""
from __future__ import annotations

import pytest

from quant_writers import assert_matches, awq_checkpoint, float_checkpoint, gptq_checkpoint


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return float_checkpoint(str(tmp_path_factory.mktemp("gptq-float")))


# (bits, group_size, sym, desc_act)
GPTQ_CASES = {
    "4bit-g32-sym": (4, 32, True, False),
    "4bit-g32-asym-desc_act": (4, 32, False, True),
    "8bit-g64-asym": (8, 64, False, False),
    "8bit-channel-sym": (8, -1, True, False),  # the cpu backend's INT8 kernel
    "8bit-channel-sym-desc_act": (8, -1, True, True),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_matches_dequantized(case: str, float_path: str, tmp_path) -> None:
    bits, gs, sym, desc_act = GPTQ_CASES[case]
    path, twin = gptq_checkpoint(float_path, str(tmp_path / case), bits, gs, sym, desc_act)
    assert_matches(path, twin)


@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_matches_dequantized(group_size: int, float_path: str, tmp_path) -> None:
    path, twin = awq_checkpoint(float_path, str(tmp_path / f"awq{group_size}"), group_size)
    assert_matches(path, twin)


def test_gptq_rows_differ_from_float(float_path: str, tmp_path) -> None:
    """The twin is not the float model: 4-bit rounding changes the output (so the equality
    above could fail on a wrong unpacking)."""
    from quant_writers import hf_reference, prompts

    _, twin = gptq_checkpoint(float_path, str(tmp_path / "g"), 4, 32, True, False)
    assert hf_reference(twin, prompts())[1] != hf_reference(float_path, prompts())[1]


@pytest.mark.parametrize("case", ["4bit-g32-sym", "4bit-g32-asym-desc_act"])
def test_gptq_tensor_parallel_2(case: str, float_path: str, tmp_path) -> None:
    """TP=2: column-parallel layers split scales with their rows; row-parallel ones split groups
    with their columns, or keep every group where columns may be in any (act order) or one scale
    spans the row (per channel)."""
    bits, gs, sym, desc_act = GPTQ_CASES[case]
    path, twin = gptq_checkpoint(float_path, str(tmp_path / case), bits, gs, sym, desc_act)
    assert_matches(path, twin, tensor_parallel_size=2)
