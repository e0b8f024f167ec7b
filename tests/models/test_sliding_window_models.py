"""Gemma 2/3 and windowed Mistral/Qwen2 beyond test_hf_equality's greedy modes: sampled-token
logprobs equal to transformers' log-softmax (soft caps and windows shape the logits themselves),
a chunked prefill over prefix-cached blocks, tensor parallel 2 and pipeline parallel 2."""
from __future__ import annotations

import pytest
from family_utils import assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy, prompts
from test_hf_equality import CASES

pytestmark = pytest.mark.timeout(900)

WINDOWED = ["gemma2", "gemma3", "mistral_window6"]


@pytest.fixture(scope="module")
def case_path(checkpoint_factory):
    def get(case: str) -> str:
        family, overrides = CASES[case]
        return checkpoint_factory(family, **overrides)

    return get


@pytest.mark.parametrize("case", WINDOWED)
def test_sampled_logprobs_match_transformers(case: str, case_path) -> None:
    assert_sampled_logprobs_match(case_path(case))


@pytest.mark.parametrize("case", ["gemma2", "mistral_window6"])
def test_chunked_prefill_over_cached_blocks(case: str, case_path) -> None:
    path = case_path(case)
    assert_greedy_matches(path, "prefix_caching_chunked_prefill", hf_greedy(path, prompts()))


def test_tensor_parallel_2(case_path) -> None:
    """4 query heads over 2 kv heads: 2 and 1 per rank; the final soft cap after the gather."""
    path = case_path("gemma2")
    assert_greedy_matches(path, "plain", hf_greedy(path, prompts()), tensor_parallel_size=2)


def test_pipeline_parallel_2(case_path) -> None:
    """3 layers over 2 stages (sliding, global | sliding): scaled embedding on the first, the
    final norm and soft cap on the last, the tied head."""
    path = case_path("gemma2")
    assert_greedy_matches(path, "plain", hf_greedy(path, prompts()), pipeline_parallel_size=2)
