"""GPT-2 (learned positions, Conv1D weights, fused c_attn, tied head, gelu_new) equals
transformers in every mode and with TP=2."""
from __future__ import annotations

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def gpt2(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("gpt2")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(gpt2, mode: str) -> None:
    path, expected = gpt2
    assert_greedy_matches(path, mode, expected)


def test_scale_attn_by_inverse_layer_idx(checkpoint_factory) -> None:
    path = checkpoint_factory("gpt2", scale_attn_by_inverse_layer_idx=True)
    assert_greedy_matches(path, "plain", hf_greedy(path, prompts()))


def test_sampled_logprobs_match_transformers(gpt2) -> None:
    assert_sampled_logprobs_match(gpt2[0])


def test_tensor_parallel_2(gpt2) -> None:
    path, expected = gpt2
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)
