"""Sampling behaviour through the whole engine on a tiny random Llama."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm import SamplingParams

from pagedllm.testing.invariants import assert_drained

PROMPT = {"prompt_token_ids": [5, 9, 30, 31, 32, 100, 7, 8]}
OTHERS = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(5)]


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seed_reproducible_whatever_else_is_in_the_batch(llm) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = gen(llm, [PROMPT], p)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True)
    batched = gen(llm, OTHERS[:2] + [PROMPT] + OTHERS[2:], [noisy] * 2 + [p] + [noisy] * 3)
    assert batched[2].outputs[0].token_ids == alone
    other_seed = gen(llm, [PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=24,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_drained(llm.llm_engine)


def test_unseeded_sampling_varies(llm) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outs = gen(llm, [PROMPT] * 4, p)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_n_and_best_of(llm) -> None:
    out = gen(llm, [PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                            ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = gen(llm, [PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, seed=7,
                                             max_tokens=10, ignore_eos=True))[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert_drained(llm.llm_engine)


def test_logprobs_match_transformers(llm, llama_path) -> None:
    from transformers import AutoModelForCausalLM

    out = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                            prompt_logprobs=2, ignore_eos=True))[0]
    comp = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    ids = PROMPT["prompt_token_ids"] + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(PROMPT["prompt_token_ids"])
    total = 0.0
    for i, tok in enumerate(comp.token_ids):
        lp = comp.logprobs[i]
        assert tok in lp and len(lp) >= 3
        assert math.isclose(lp[tok], ref[n_prompt - 1 + i, tok].item(), abs_tol=1e-4)
        top = ref[n_prompt - 1 + i].topk(3).indices.tolist()
        assert set(top) <= set(lp)
        total += lp[tok]
    assert math.isclose(comp.cumulative_logprob, total, abs_tol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for pos in range(1, n_prompt):
        tok = PROMPT["prompt_token_ids"][pos]
        assert math.isclose(out.prompt_logprobs[pos][tok], ref[pos - 1, tok].item(), abs_tol=1e-4)


def test_greedy_top_k_one_equals_greedy(llm) -> None:
    g = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    k1 = gen(llm, [PROMPT], SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True))
    p0 = gen(llm, [PROMPT], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12,
                                           ignore_eos=True))
    m1 = gen(llm, [PROMPT], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12,
                                           ignore_eos=True))
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids == p0[0].outputs[0].token_ids \
        == m1[0].outputs[0].token_ids


def test_penalties_change_output(llm) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = gen(llm, [PROMPT], base)[0].outputs[0].token_ids
    for kw in (dict(repetition_penalty=1.8), dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        pen = gen(llm, [PROMPT], SamplingParams(**kw, temperature=0.0, max_tokens=30,
                                                ignore_eos=True))[0].outputs[0].token_ids
        assert pen != plain, kw
        # penalized greedy decoding repeats tokens less
        assert len(set(pen)) >= len(set(plain)), kw


def test_stop_token_ids_and_min_tokens(llm) -> None:
    plain = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=20,
                                              ignore_eos=True))[0].outputs[0].token_ids
    target = plain[4]
    first = plain.index(target)
    out = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                            stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == plain[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    late = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                             stop_token_ids=[target], min_tokens=first + 1))
    assert len(late[0].outputs[0].token_ids) > first + 1


def test_stop_string_spanning_tokens_is_cut(llm) -> None:
    text = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=30,
                                             ignore_eos=True))[0].outputs[0].text
    assert len(text) >= 8
    stop = text[3:6]  # byte-level tokens: the stop string spans three tokens
    idx = text.find(stop)
    out = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                            stop=[stop]))[0].outputs[0]
    assert out.text == text[:idx] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                             stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:idx + len(stop)]


def test_eos_from_generation_config_stops_unless_ignored(llm, llama_path, tmp_path) -> None:
    import json
    import shutil

    from pagedllm import LLM

    plain = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=15,
                                              ignore_eos=True))[0].outputs[0].token_ids
    eos = plain[3]
    path = shutil.copytree(llama_path, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 2]}))
    other = LLM(str(path), device="cpu", dtype="float32", max_model_len=256)
    out = gen(other, [PROMPT], SamplingParams(temperature=0.0, max_tokens=15))[0].outputs[0]
    assert out.token_ids == plain[:plain.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = gen(other, [PROMPT], SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True))
    assert ignored[0].outputs[0].token_ids == plain


def test_max_tokens_none_runs_to_model_length(llm) -> None:
    out = gen(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(PROMPT["prompt_token_ids"]) + len(out[0].outputs[0].token_ids) == 256
    assert out[0].outputs[0].finish_reason == "length"
