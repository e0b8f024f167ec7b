from __future__ import annotations

import math

import pytest

from pagedllm import SamplingParams


@pytest.mark.parametrize("field,value,allowed", [
    ("n", 0, ">= 1"), ("temperature", -0.1, "[0, 2]"), ("temperature", 2.5, "[0, 2]"),
    ("temperature", math.nan, "[0, 2]"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_k", 0, "-1"), ("min_p", 1.5, "[0, 1]"), ("max_tokens", 0, ">= 1"),
    ("presence_penalty", 3.0, "[-2, 2]"), ("frequency_penalty", -2.5, "[-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 2]"), ("logprobs", -1, ">= 0"), ("prompt_logprobs", -2, ">= 0"),
    ("min_tokens", -1, ">= 0"), ("stop", [""], "non-empty"), ("timeout_seconds", 0, "> 0"),
    ("seed", 1.5, "integer"), ("stop_token_ids", [-1], ">= 0"),
])
def test_invalid_values_name_field_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert f"SamplingParams.{field}=" in msg and allowed in msg


def test_best_of_and_min_tokens_relations() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(n=2).best_of == 2


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) == (1, 1.0, 1.0, -1, 16, [])
    assert SamplingParams(stop="x").stop == ["x"]


def test_clone_shares_no_container() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[3], seed=5, temperature=0.5)
    p.all_stop_token_ids.add(9)
    c = p.clone()
    assert c == p and c.all_stop_token_ids == {3, 9}
    c.stop.append("b")
    c.stop_token_ids.append(4)
    c.all_stop_token_ids.add(11)
    assert (p.stop, p.stop_token_ids, p.all_stop_token_ids) == (["a"], [3], {3, 9})
