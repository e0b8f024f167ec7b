"""Guided decoding offline (LLM.generate with SamplingParams(guided_decoding=...)).

A random-weight model follows no format on its own, so every output that matches its constraint
shows the constraint was enforced. Schemas bound every string, number and array, so an output
always completes within max_tokens and must parse.
"""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.sampling_params import GuidedDecodingParams
from pagedllm.testing.invariants import assert_drained

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}@(x|yz)\.com"
CHOICES = ["yes", "no", 'say "maybe"']
PROMPTS = ["hello", "the sky is", "1 2 3"]


def _sample(gd: GuidedDecodingParams, **kw: object) -> SamplingParams:
    kw = {"temperature": 1.0, "seed": 7, "max_tokens": 80, **kw}
    return SamplingParams(guided_decoding=gd, **kw)  # type: ignore[arg-type]


def _texts(llm: LLM, params: SamplingParams | list[SamplingParams],
           prompts: list[str] = PROMPTS) -> list[str]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_drained(llm.llm_engine)
    return [c.text for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def llm(llama_path: str) -> LLM:
    return LLM(llama_path, device="cpu", dtype="float32", max_model_len=256)


def test_json_schema_with_n_and_best_of(llm: LLM) -> None:
    params = _sample(GuidedDecodingParams(json=SCHEMA), n=2, best_of=3)
    texts = _texts(llm, params)
    assert len(texts) == 2 * len(PROMPTS)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one fixed string


def test_regex_choice_and_grammar(llm: LLM) -> None:
    params = [_sample(GuidedDecodingParams(regex=REGEX), n=2),
              _sample(GuidedDecodingParams(choice=CHOICES), n=2),
              _sample(GuidedDecodingParams(grammar='root ::= "(" [0-9]{1,4} ("," [0-9]{1,4})* ")"'),
                      n=2, max_tokens=40)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    regex_out, choice_out, grammar_out = ([c for c in o.outputs] for o in outs)
    for c in regex_out:
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.finish_reason == "stop"
    for c in choice_out:
        assert c.text in CHOICES
    for c in grammar_out:  # may run to max_tokens: a prefix of the language then
        pattern = r"\([0-9]{1,4}(,[0-9]{1,4})*\)" if c.finish_reason == "stop" \
            else r"\([0-9]{1,4}(,[0-9]{1,4})*,?[0-9]{0,4}"
        assert re.fullmatch(pattern, c.text), c.text


def test_json_object_is_json_when_finished(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, _sample(GuidedDecodingParams(json_object=True), max_tokens=60),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_greedy_guided_is_the_masked_argmax(llm: LLM) -> None:
    """Greedy under a choice constraint picks the allowed first token the model likes best."""
    tok = llm.get_tokenizer()
    prompt = [5, 17, 33, 9]
    free = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                        use_tqdm=False)[0].outputs[0]
    firsts = {tok("x" + c[0], add_special_tokens=False).input_ids[-1]: c for c in CHOICES}
    lp = free.logprobs[0]
    ranked = [t for t in sorted(lp, key=lp.get, reverse=True) if t in firsts]
    guided = llm.generate([{"prompt_token_ids": prompt}],
                          _sample(GuidedDecodingParams(choice=CHOICES), temperature=0),
                          use_tqdm=False)[0].outputs[0]
    if ranked:  # the best allowed first token is among the model's top 20
        assert guided.text == firsts[ranked[0]]
    assert guided.text in CHOICES


def test_stop_strings_cut_guided_output(llm: LLM) -> None:
    texts = _texts(llm, _sample(GuidedDecodingParams(regex="[a-c]{30}"), stop=["c"], n=2))
    for text in texts:
        assert re.fullmatch("[ab]{0,29}", text), text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_the_matcher(llm: LLM, llama_path: str,
                                                        mode: str) -> None:
    """Greedy guided outputs under preemption (and prefix caching) equal those of a roomy cache."""
    params = [_sample(GuidedDecodingParams(json=SCHEMA), temperature=0, max_tokens=60),
              _sample(GuidedDecodingParams(regex="[a-z]{20,30}"), temperature=0, max_tokens=40)]
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 9] * 3} for i in range(4)]
    params = [params[i % 2] for i in range(4)]
    tight = LLM(llama_path, device="cpu", dtype="float32", max_model_len=128,
                num_gpu_blocks_override=20, block_size=4, max_num_seqs=4, preemption_mode=mode,
                enable_prefix_caching=True)
    expect = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.stats().num_preemptions > 0
    assert got == expect
    for i, text in enumerate(got):
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch("[a-z]{20,30}", text)
    assert_drained(tight.llm_engine)


def test_no_step_ahead_of_a_guided_token(llama_path: str) -> None:
    """With steps scheduled ahead (cuda's async output), guided requests still get each step's
    mask from their last token: outputs equal the plain path's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuBackend, "capabilities",
                   dataclasses.replace(CpuBackend.capabilities, async_output=True))
        ahead = LLM(llama_path, device="cpu", dtype="float32", max_model_len=128)
    assert type(ahead.llm_engine.stepper).__name__ == "AheadStepper"
    plain = LLM(llama_path, device="cpu", dtype="float32", max_model_len=128)
    params = [_sample(GuidedDecodingParams(regex="[a-z]{5,9}"), temperature=0),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    prompts = ["one", "two"]
    a = [o.outputs[0].text for o in ahead.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    assert a == b and re.fullmatch("[a-z]{5,9}", a[0])
    assert_drained(ahead.llm_engine)


@pytest.mark.parametrize("gd, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "guided_decoding.json"),
    (dict(regex="(ab"), "guided_decoding.regex"),
    (dict(grammar="root ::= "), "guided_decoding.grammar"),
    (dict(json="{not json"), "GuidedDecodingParams.json"),
    (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(backend="outlines", regex="a"), "GuidedDecodingParams.backend"),
])
def test_bad_constraints_name_the_field(llm: LLM, gd: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(**gd)),
                     use_tqdm=False)
    assert_drained(llm.llm_engine)


def test_compile_timeout_fails_only_that_request(llama_path: str) -> None:
    import threading

    llm = LLM(llama_path, device="cpu", dtype="float32", max_model_len=128)
    service = llm.llm_engine.guided.service
    service.timeout_s = 0.2
    release = threading.Event()
    compile_ = service._compile
    service._compile = lambda p: (release.wait(5), compile_(p))[1]  # a compile that hangs
    try:
        outs = llm.generate(["a", "b"], [_sample(GuidedDecodingParams(regex="[0-9]+")),
                                         SamplingParams(temperature=0, max_tokens=5)],
                            use_tqdm=False)
    finally:
        release.set()
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "longer than 0.2 s" in (outs[0].error or "")
    assert len(outs[1].outputs[0].token_ids) > 0
    assert_drained(llm.llm_engine)


def test_offline_logprobs_are_logprob_objects(llm: LLM) -> None:
    """As vLLM's: ``v.logprob``, ``v.rank`` (1 = most likely) and ``v.decoded_token``."""
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                               prompt_logprobs=2), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    c = out.outputs[0]
    for token, entry in zip(c.token_ids, c.logprobs):
        assert entry[token].rank == 1  # greedy: the chosen token is the most likely
        ranked = sorted(entry.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert all(v.decoded_token == tok.decode([t]) for t, v in entry.items())
    total = sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs))
    assert total == pytest.approx(c.cumulative_logprob, abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for target, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert target in entry and entry[target].logprob <= 0.0
        ranks = sorted(v.rank for v in entry.values() if v.rank is not None)
        assert ranks == [1, 2]


def test_pipeline_parallel_guided(llama_path: str) -> None:
    """PP=2 (two virtual engines, two stage workers): guided requests, best_of forks included,
    are placed like any request and their outputs match the constraint."""
    llm = LLM(llama_path, device="cpu", dtype="float32", max_model_len=128,
              pipeline_parallel_size=2)
    try:
        params = [_sample(GuidedDecodingParams(regex="[a-c]{3,8}@x"), seed=i, n=2, best_of=3)
                  for i in range(4)]
        outs = llm.generate([f"p{i}" for i in range(4)], params, use_tqdm=False)
        texts = [c.text for o in outs for c in o.outputs]
        assert len(texts) == 8 and all(re.fullmatch("[a-c]{3,8}@x", t) for t in texts), texts
    finally:
        llm.llm_engine.shutdown()


def test_mask_filled_during_the_forward_equals_the_serial_fill(llm: LLM) -> None:
    """The step's mask filled on the helper thread while the forward runs (the default) gives
    the same tokens as filling it on the engine thread first; n > 1 forks matchers meanwhile."""
    from pagedllm.engine.guided.manager import PendingBitmask

    guided = llm.llm_engine.guided
    params = [_sample(GuidedDecodingParams(json=SCHEMA), n=2),
              _sample(GuidedDecodingParams(regex=REGEX), seed=3),
              SamplingParams(temperature=1.0, seed=5, max_tokens=10)]
    seen: list[object] = []
    bitmask = guided.bitmask
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(guided, "bitmask", lambda sched: seen.append(bitmask(sched)) or seen[-1])
        mp.setattr(guided, "overlap", True)  # cpu's default is False (no async output)
        overlapped = _texts(llm, params)
        mp.setattr(guided, "overlap", False)
        serial = _texts(llm, params)
    assert overlapped == serial
    pending = [m for m in seen if isinstance(m, PendingBitmask)]
    assert pending and len(pending) < len(seen), "both paths should have run"
    import pickle

    import torch

    mask = pickle.loads(pickle.dumps(pending[-1]))  # an executor sending it to a worker
    assert isinstance(mask, torch.Tensor) and torch.equal(mask, pending[-1].result())
