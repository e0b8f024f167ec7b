"""logit_bias, allowed_token_ids and bad_words through LLM.generate (vLLM / OpenAI semantics)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 33, 9, 41, 8]}


def _greedy(llm: LLM, logprobs: int | None = None, **kw: object):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=logprobs,
                            **kw)  # type: ignore[arg-type]
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_logit_bias_shifts_the_distribution(llm: LLM) -> None:
    base = _greedy(llm, logprobs=5)
    first = base.token_ids[0]
    lp = base.logprobs[0]
    runner_up = sorted((t for t in lp if t != first), key=lp.get, reverse=True)[0]
    gap = lp[first] - lp[runner_up]
    # a bias just over the gap makes the runner-up the argmax; just under leaves the order
    assert _greedy(llm, logit_bias={runner_up: gap + 0.01}).token_ids[0] == runner_up
    assert _greedy(llm, logit_bias={runner_up: max(gap - 0.01, 0)}).token_ids[0] == first
    assert set(_greedy(llm, logit_bias={77: 100}).token_ids) == {77}
    banned = _greedy(llm, logit_bias={t: -100 for t in base.token_ids})
    assert not set(banned.token_ids) & set(base.token_ids)


def test_allowed_token_ids_and_sampling(llm: LLM) -> None:
    allowed = [40, 41, 200]
    outs = llm.generate([PROMPT], SamplingParams(temperature=1.5, n=3, seed=1, max_tokens=20,
                                                 allowed_token_ids=allowed), use_tqdm=False)
    for c in outs[0].outputs:
        assert set(c.token_ids) <= set(allowed)
        assert len(c.token_ids) == 20


def test_bad_words_single_and_multi_token(llm: LLM) -> None:
    base = _greedy(llm)
    tok = llm.get_tokenizer()
    text = base.text
    word = text[2:4]  # two byte tokens the model produces unconstrained
    assert len(tok(word, add_special_tokens=False).input_ids) == 2
    out = _greedy(llm, bad_words=[word])
    assert word not in out.text
    assert out.text[:2] == text[:2]  # the first token of the word alone is not banned
    single = text[0]
    assert single not in _greedy(llm, bad_words=[single]).text


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words="abc"), "bad_words"),
])
def test_bad_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_ids_out_of_the_vocabulary(llm: LLM) -> None:
    for kw, field in ((dict(logit_bias={10**6: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"{field}: token id 1000000 is out of range"):
            llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)
