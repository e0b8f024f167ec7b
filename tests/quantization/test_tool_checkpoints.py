"""Checkpoints written by the real quantization tools (gptqmodel, llm-compressor) load in
pagedllm and match the reference: greedy tokens equal, each chosen token's logprob close.

The checkpoints come from tool_checkpoints.py, run in side venvs by .ci/leg_quant_tools.sh,
which points PAGEDLLM_QUANT_TOOL_CHECKPOINTS at the folder; without it (a plain `pytest tests`)
every test here skips. The reference is transformers on the same checkpoint where it runs it on
CPU (compressed-tensors), else transformers on the checkpoint's float32 twin dequantized by the
tool's own code (GPTQ, AWQ).
"""
from __future__ import annotations

import json
import os

import pytest

from quant_writers import assert_matches
from tool_checkpoints import CASES

ENV = "PAGEDLLM_QUANT_TOOL_CHECKPOINTS"
ROOT = os.environ.get(ENV, "")
pytestmark = pytest.mark.skipif(
    not ROOT, reason=f"{ENV} is unset: tool-made checkpoints are written by "
                     ".ci/leg_quant_tools.sh (gptqmodel / llm-compressor side venvs)")

# checkpoints transformers runs itself on CPU (compressed-tensors decompresses on load), except
# those it cannot: the asymmetric W4A16 one (transformers 5.25 with compressed-tensors 0.20 sizes
# weight_zero_point unpacked, [out, G], and refuses the packed [out / 8, G] tensor)
TRANSFORMERS_LOADS = {"llmcompressor"}
TWIN_REFERENCE = {"ct-w4a16-asym-g32"}
# dynamic per-token FP8 activations: pagedllm and compressed-tensors' forward round the same
# values through e4m3 (scale amax / 448), but a value on a rounding boundary after a float32
# ulp of difference moves by a whole e4m3 step (1/8 relative): seen up to 0.04 in a logprob
ATOL = {"ct-fp8-dynamic": 0.05, "ct-fp8-tensor-dynamic": 0.05}


def case_path(tool: str, case: str) -> str:
    """The case's folder; a tool that ran but did not write a listed case fails, not skips."""
    manifest = os.path.join(ROOT, f"{tool}.json")
    assert os.path.isfile(manifest), f"{manifest} missing: did tool_checkpoints.py {tool} run?"
    with open(manifest) as fh:
        written = json.load(fh)["cases"]
    assert case in written, f"{tool} wrote {written}, not {case}"
    return os.path.join(ROOT, case)


@pytest.mark.parametrize("tool,case", [(t, c) for t, cs in CASES.items() for c in cs])
def test_tool_checkpoint_matches_reference(tool: str, case: str) -> None:
    path = case_path(tool, case)
    twin = tool not in TRANSFORMERS_LOADS or case in TWIN_REFERENCE
    reference = path + "-dequant" if twin else path
    assert_matches(path, reference, atol=ATOL.get(case, 1e-3))


@pytest.mark.parametrize("tool,case", [(t, c) for t, cs in CASES.items() for c in cs])
def test_tool_checkpoint_is_quantized(tool: str, case: str) -> None:
    """The comparison above can fail: the checkpoint holds no float linear weights, and the tool
    rounded them (the twin's weights differ from the float source's)."""
    import torch
    from safetensors.torch import load_file

    path = case_path(tool, case)
    with open(os.path.join(path, "config.json")) as fh:
        assert "quantization_config" in json.load(fh)
    src = load_file(os.path.join(ROOT, "float", "model.safetensors"))
    got = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    if tool in TRANSFORMERS_LOADS:
        stored = got.get(name)  # fp8 keeps ".weight" (as float8); int formats pack it
        assert stored is None or stored.dtype == torch.float8_e4m3fn
    else:
        assert name not in got
        twin = load_file(os.path.join(path + "-dequant", "model.safetensors"))[name]
        assert not torch.equal(twin, src[name].float())
        assert torch.allclose(twin, src[name].float(), atol=0.1)  # rounded, not garbage
