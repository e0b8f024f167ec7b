"""LLMEngine request lifecycle: validation, abort, timeout, stats, and the LLM front end."""
from __future__ import annotations

import time

import pytest

from pagedllm import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from pagedllm.testing.invariants import assert_drained


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_generate_accepts_every_prompt_form_in_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = tok("hello there").input_ids
    by_text = llm.generate("hello there", p, use_tqdm=False)
    by_ids = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids
    assert by_text[0].prompt == "hello there" and by_text[0].prompt_token_ids == ids
    outs = llm.generate(["a", "bb", {"prompt_token_ids": [5, 6]}], use_tqdm=False,
                        sampling_params=[p, SamplingParams(max_tokens=2, temperature=0.0,
                                                           ignore_eos=True), p])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2, 4]
    assert [o.prompt for o in outs] == ["a", "bb", None]
    assert all(o.finished for o in outs)
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [p, p], use_tqdm=False)


def test_chat_applies_template(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)
    expected = llm.get_tokenizer()("<|user|>hi\n<|assistant|>").input_ids
    assert out[0].prompt_token_ids == expected and len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 10**6]}, "out of range"),
    ({"prompt_token_ids": [3, -1, 4]}, "token id -1 is out of range"),
    ({"prompt_token_ids": [3, 4.0]}, "token id 4.0 is out of range"),
    ({"prompt_token_ids": [5] * 300}, "max_model_len=256"),
    (3.5, "prompt must be"),
])
def test_bad_prompts_are_rejected(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.llm_engine.add_request("bad", prompt, SamplingParams())
    assert_drained(llm.llm_engine)


def test_duplicate_request_id_rejected(llm: LLM) -> None:
    eng = llm.llm_engine
    eng.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    run_all(eng)
    assert_drained(eng)


def test_abort_in_flight_reports_abort_and_frees(llm: LLM) -> None:
    eng = llm.llm_engine
    p = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    eng.add_request("keep", {"prompt_token_ids": [5, 6, 7]}, p)
    eng.add_request("drop", {"prompt_token_ids": [8, 9, 10]}, p)
    eng.add_request("never", {"prompt_token_ids": [11]}, p)
    eng.abort_request("never")
    early = {o.request_id: o for _ in range(3) for o in eng.step() if o.finished}
    eng.abort_request(["drop"])
    final = {**early, **run_all(eng)}
    assert final["drop"].outputs[0].finish_reason == "abort"
    assert 0 < len(final["drop"].outputs[0].token_ids) < 50
    assert final["never"].outputs[0].finish_reason == "abort"
    assert len(final["keep"].outputs[0].token_ids) == 50
    assert_drained(eng)


def test_timeout_returns_partial_output(llm: LLM) -> None:
    eng = llm.llm_engine
    eng.add_request("slow", {"prompt_token_ids": [5, 6, 7]},
                    SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                                   timeout_seconds=0.3))
    start = time.monotonic()
    # the first step samples a token; the deadline then passes before the next one (without the
    # pause a fast machine finished all 200 tokens within 0.3 s)
    assert not any(o.finished for o in eng.step())
    time.sleep(0.35)
    final = run_all(eng)
    out = final["slow"].outputs[0]
    assert out.finish_reason == "timeout" and 0 < len(out.token_ids) < 200
    assert time.monotonic() - start < 5
    assert_drained(eng)


def test_engine_from_engine_args_and_stats(llama_path: str) -> None:
    eng = LLMEngine.from_engine_args(EngineArgs(model=llama_path, device="cpu", dtype="float32",
                                                num_gpu_blocks_override=40, block_size=8))
    s = eng.stats()
    assert (s.num_blocks, s.num_free_blocks, s.block_size) == (40, 40, 8)
    eng.add_request("a", {"prompt_token_ids": list(range(3, 30))},
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert eng.get_num_unfinished_requests() == 1
    eng.step()
    s = eng.stats()
    assert s.num_running == 1 and s.num_free_blocks == 40 - 4
    run_all(eng)
    assert_drained(eng)


def test_invalid_engine_args_name_the_field(llama_path: str) -> None:
    with pytest.raises(ValueError, match="block_size=3"):
        LLM(llama_path, device="cpu", block_size=3)
    with pytest.raises(ValueError, match="preemption_mode='later'"):
        LLM(llama_path, device="cpu", preemption_mode="later")
    with pytest.raises(ValueError, match=r"max_model_len=100000.*\[1, 512\]"):
        LLM(llama_path, device="cpu", max_model_len=100000)
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_path, device="cpu", dtype="int3")
    with pytest.raises(ValueError, match="not a local folder"):
        LLM("meta-llama/nonexistent", device="cpu")


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"],
                                                      "model_type": "falcon"}))
    from pagedllm.testing.checkpoints import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*not supported.*GPT2LMHeadModel.*"
                                         r"LlamaForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_final_only_requests_report_once_and_match_cumulative(llm: LLM) -> None:
    from pagedllm import RequestOutputKind

    engine = llm.llm_engine
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        engine.add_request(kind.name, prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                             ignore_eos=True, output_kind=kind))
    seen: dict[str, list[RequestOutput]] = {"CUMULATIVE": [], "FINAL_ONLY": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["CUMULATIVE"]) == 6 and len(seen["FINAL_ONLY"]) == 1
    final = seen["FINAL_ONLY"][0]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == seen["CUMULATIVE"][-1].outputs[0].token_ids
    assert final.outputs[0].text == seen["CUMULATIVE"][-1].outputs[0].text
    assert_drained(engine)


def _joined(outs: list[RequestOutput], index: int) -> tuple[str, list[int], list]:
    text, ids, lps = "", [], []
    for o in outs:
        c = next(c for c in o.outputs if c.index == index)
        text, ids, lps = text + c.text, ids + c.token_ids, lps + (c.logprobs or [])
    return text, ids, lps


@pytest.mark.parametrize("extra", [
    dict(n=1),
    dict(n=3, temperature=1.0, seed=7, logprobs=2),  # forks; per-token logprobs
    dict(n=1, stop=["e", "zzzz"]),  # text held back (3 characters), cut at the stop string
])
def test_delta_outputs_add_up_to_the_cumulative_ones(llm: LLM, extra: dict) -> None:
    from pagedllm import RequestOutputKind

    engine = llm.llm_engine
    prompt = {"prompt": "hello there", "prompt_token_ids": [5, 6, 7, 8, 9]}
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    base.update(extra)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine.add_request(kind.name, prompt, SamplingParams(output_kind=kind, **base))
    seen: dict[str, list[RequestOutput]] = {"CUMULATIVE": [], "DELTA": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    cum, delta = seen["CUMULATIVE"], seen["DELTA"]
    assert len(cum) == len(delta) and delta[-1].finished and not any(o.finished for o in delta[:-1])
    final = cum[-1]
    for c in final.outputs:
        text, ids, lps = _joined(delta, c.index)
        assert (text, ids) == (c.text, c.token_ids) and c.token_ids
        assert lps == (c.logprobs or [])
        assert delta[-1].outputs[c.index].finish_reason == c.finish_reason
        assert delta[-1].outputs[c.index].cumulative_logprob == c.cumulative_logprob
    # what each delta adds is exactly what the cumulative output of the same step added
    for before, after, d in zip([None, *cum], cum, delta):
        for c, dc in zip(after.outputs, d.outputs):
            prev = before.outputs[c.index] if before is not None else None
            assert dc.token_ids == c.token_ids[len(prev.token_ids) if prev else 0:]
            assert dc.text == c.text[len(prev.text) if prev else 0:]
    # the prompt fields come with the first delta only (as vLLM)
    assert delta[0].prompt_token_ids == [5, 6, 7, 8, 9] and delta[0].prompt == "hello there"
    assert delta[0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_token_ids is None and o.prompt_logprobs is None for o in delta[1:])
    assert_drained(engine)
    assert not engine.output_processor._reported  # nothing is kept after a request finishes


def test_delta_is_validated() -> None:
    from pagedllm import RequestOutputKind

    SamplingParams(output_kind=RequestOutputKind.DELTA, n=2)
    with pytest.raises(ValueError, match=r"output_kind.*best_of == n.*best_of=3, n=2"):
        SamplingParams(output_kind=RequestOutputKind.DELTA, n=2, best_of=3, temperature=1.0)
    with pytest.raises(ValueError, match="output_kind.*allowed"):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
