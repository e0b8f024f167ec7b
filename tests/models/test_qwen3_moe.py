"""Qwen3-MoE (a sparse layer and a dense mlp_only layer; GQA group 3) equals transformers in
every mode, with norm_topk_prob off and on, and with TP=2."""
from __future__ import annotations

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen3_moe(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("qwen3_moe")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(qwen3_moe, mode: str) -> None:
    path, expected = qwen3_moe
    assert_greedy_matches(path, mode, expected)


def test_norm_topk_prob(checkpoint_factory) -> None:
    """Routing weights renormalized over the chosen experts; every layer sparse."""
    path = checkpoint_factory("qwen3_moe", norm_topk_prob=True, mlp_only_layers=None)
    assert_greedy_matches(path, "plain", hf_greedy(path, prompts()))


def test_sampled_logprobs_match_transformers(qwen3_moe) -> None:
    assert_sampled_logprobs_match(qwen3_moe[0])


def test_tensor_parallel_2(qwen3_moe) -> None:
    path, expected = qwen3_moe
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)


def test_pipeline_parallel_2(qwen3_moe) -> None:
    """Stage 0 runs the sparse layer, stage 1 the dense mlp_only layer."""
    path, expected = qwen3_moe
    assert_greedy_matches(path, "plain", expected, pipeline_parallel_size=2)
