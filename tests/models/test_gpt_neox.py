"""GPT-NeoX (parallel residual, partial rotary over a quarter of each head, q/k/v interleaved per
head) equals transformers in every mode, with the sequential residual too, and with TP=2."""
from __future__ import annotations

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def neox(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("gpt_neox")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(neox, mode: str) -> None:
    path, expected = neox
    assert_greedy_matches(path, mode, expected)


def test_sequential_residual(checkpoint_factory) -> None:
    path = checkpoint_factory("gpt_neox", use_parallel_residual=False)
    assert_greedy_matches(path, "plain", hf_greedy(path, prompts()))


def test_sampled_logprobs_match_transformers(neox) -> None:
    assert_sampled_logprobs_match(neox[0])


def test_tensor_parallel_2(neox) -> None:
    path, expected = neox
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)
