"""Qwen3 (per-head q/k RMSNorm; head_dim 80, GQA group 3) equals transformers in every mode."""
from __future__ import annotations

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen3(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("qwen3")
    return path, hf_greedy(path, prompts())


def test_checkpoint_shape(qwen3) -> None:
    import json
    import os

    with open(os.path.join(qwen3[0], "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 80 and cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 3


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(qwen3, mode: str) -> None:
    path, expected = qwen3
    assert_greedy_matches(path, mode, expected)


def test_sampled_logprobs_match_transformers(qwen3) -> None:
    assert_sampled_logprobs_match(qwen3[0])


def test_tensor_parallel_2(qwen3) -> None:
    """6 query heads and 2 KV heads over 2 ranks: 3 query heads and one KV head per rank."""
    path, expected = qwen3
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)
