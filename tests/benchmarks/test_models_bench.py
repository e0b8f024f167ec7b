"""benchmarks/make_model.py's issue-31 presets and models_bench.py's roofline: the shape presets
have the published models' parameter counts, each preset turns on its architecture's features,
and a MoE's decode step reads only the experts a batch reaches."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import make_model  # noqa: E402
import models_bench  # noqa: E402


@pytest.mark.parametrize("preset, published", [
    ("mixtral-8x7b-shape", 46_702_792_704),  # Mixtral-8x7B-v0.1's safetensors index
    ("qwen3-8b-shape", 8_190_735_360),  # Qwen3-8B's
])
def test_shape_presets_match_published_sizes(preset: str, published: int) -> None:
    assert make_model.count_parameters(make_model.make_config(preset, "bfloat16")) == published


def test_presets_turn_on_their_features() -> None:
    gemma = make_model.make_config("gemma2-100m", "bfloat16")
    assert gemma.model_type == "gemma2" and gemma.architectures == ["Gemma2ForCausalLM"]
    assert (gemma.sliding_window, gemma.attn_logit_softcapping,
            gemma.final_logit_softcapping) == (128, 50.0, 30.0)
    assert "sliding_attention" in gemma.layer_types and "full_attention" in gemma.layer_types
    moe = make_model.make_config("mixtral-moe-100m", "bfloat16")
    assert (moe.model_type, moe.num_local_experts, moe.num_experts_per_tok) == ("mixtral", 8, 2)
    for preset in ("mixtral-moe-100m", "gemma2-100m"):  # "~100M"
        n = make_model.count_parameters(make_model.make_config(preset, "bfloat16"))
        assert 90e6 < n < 105e6, (preset, n)


def test_config_only_checkpoint(tmp_path: Path) -> None:
    out = make_model.write_checkpoint(tmp_path / "q", "qwen3-8b-shape", "bfloat16", 0)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert not list(out.glob("*.safetensors"))
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out)) == config["vocab_size"]


def test_moe_decode_reads_only_reached_experts() -> None:
    assert models_bench.expected_experts(8, 2, 1) == pytest.approx(2.0)
    assert models_bench.expected_experts(8, 2, 256) == pytest.approx(8.0)
    config = make_model.make_config("mixtral-8x7b-shape", "bfloat16")
    # batch 1: the published 12.9B active parameters less the 32000 x 4096 embedding, in bf16
    one = models_bench.decode_weight_bytes(config, 1)
    assert one / 2 == pytest.approx(12.9e9 - 32000 * 4096, rel=0.01)
    # a full batch reaches every expert: all weights but the embedding
    full = models_bench.decode_weight_bytes(config, 256)
    assert full / 2 == pytest.approx(46_702_792_704 - 32000 * 4096, rel=1e-6)


def test_mixtral_shape_is_refused_before_loading_on_an_80gb_card() -> None:
    """Issue 39: Mixtral-8x7B's 93 GB of bf16 weights cannot fit an H100 (80 GB) and the
    benchmark says so up front; it fits an H200 (141 GB), as does Qwen3-8B on either."""
    gb = 1000 ** 3
    mixtral = make_model.make_config("mixtral-8x7b-shape", "bfloat16")
    qwen = make_model.make_config("qwen3-8b-shape", "bfloat16")
    fits, text = models_bench.fits_on_device(mixtral, 80 * gb)
    assert not fits and "GiB" in text
    assert models_bench.fits_on_device(mixtral, 141 * gb)[0]
    assert models_bench.fits_on_device(qwen, 80 * gb)[0]
