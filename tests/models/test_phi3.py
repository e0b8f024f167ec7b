"""Phi-3 (fused qkv and gate_up in the checkpoint, LongRoPE with short and long factors, half the
head rotated, head_dim 96) equals transformers in every mode."""
from __future__ import annotations

import random

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def phi3(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("phi3")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(phi3, mode: str) -> None:
    path, expected = phi3
    assert_greedy_matches(path, mode, expected)


def test_prompt_longer_than_original_context(phi3) -> None:
    """A prompt past original_max_position_embeddings=70 is prefilled with the long factors,
    the way transformers' forward over the whole prompt picks them."""
    from test_hf_equality import MAX_TOKENS

    rng = random.Random(3)
    ps = [[rng.randint(3, 258) for _ in range(n)] for n in (90, 71)]
    expected = hf_greedy(phi3[0], ps)
    llm = LLM(phi3[0], device="cpu", dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_sampled_logprobs_match_transformers(phi3) -> None:
    assert_sampled_logprobs_match(phi3[0])


def test_tensor_parallel_2(phi3) -> None:
    """The fused checkpoint tensors are split, then sharded by head (one KV head per rank)."""
    path, expected = phi3
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)
