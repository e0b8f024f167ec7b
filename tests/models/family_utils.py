"""Checks every family test runs (tests/models/test_<family>.py), over test_hf_equality's prompts,
modes and Hugging Face reference: greedy tokens equal to transformers' in a mode, tensor parallel
greedy tokens, and sampled-token logprobs equal to transformers' log-softmax."""
from __future__ import annotations

import math
from typing import Any

import torch
from test_hf_equality import MAX_TOKENS, prompts
from test_hf_equality import MODES as _HF_MODES

from pagedllm import LLM, SamplingParams

__all__ = ["MODES", "assert_greedy_matches", "assert_sampled_logprobs_match", "hf_greedy",
           "prompts"]


# test_hf_equality's modes plus both cache features at once (a chunked prefill over cached blocks)
MODES: dict[str, dict[str, Any]] = {
    **_HF_MODES,
    "prefix_caching_chunked_prefill": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                                           max_num_batched_tokens=16, max_num_seqs=4),
}


def hf_greedy(path: str, ps: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of ``ps`` (float32), MAX_TOKENS each: the checkpoint's
    generation_config.json names eos_token_id=2, which transformers 5 applies even when the
    GenerationConfig passed says None, so it is cleared on the model (the engine runs with
    ignore_eos)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in ps]


def _greedy(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_greedy_matches(path: str, mode: str, expected: list[list[int]],
                          **engine_kwargs: Any) -> None:
    """The engine in ``mode`` (a key of MODES) gives ``expected`` (transformers' greedy tokens for
    ``prompts()``); prefix caching is checked on a second pass that hits the cache and
    preemption modes must have preempted."""
    llm = LLM(path, device="cpu", dtype="float32", **MODES[mode], **engine_kwargs)
    try:
        assert _greedy(llm, prompts()) == expected
        if mode.startswith("prefix_caching"):
            hits = llm.llm_engine.block_manager.num_prefix_hit_blocks
            assert _greedy(llm, prompts()) == expected
            assert llm.llm_engine.block_manager.num_prefix_hit_blocks > hits
        stats = llm.llm_engine.stats()
        if mode.startswith("preempt"):
            assert stats.num_preemptions > 0
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    finally:
        llm.llm_engine.shutdown()


def assert_sampled_logprobs_match(path: str, num_prompts: int = 3, tokens: int = 8,
                                  **engine_kwargs: Any) -> None:
    """Random sampling (temperature 1, seeded): the logprob the engine reports for each sampled
    token and its top-3 alternatives equals transformers' log-softmax at that position."""
    from transformers import AutoModelForCausalLM

    llm = LLM(path, device="cpu", dtype="float32", **engine_kwargs)
    try:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, logprobs=3,
                                ignore_eos=True)
        ps = prompts()[:num_prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    checked = 0
    for p, out in zip(ps, outs):
        comp = out.outputs[0]
        with torch.no_grad():
            logits = model(torch.tensor([p + comp.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)  # [len, vocab]
        for i, tok in enumerate(comp.token_ids):
            row = ref[len(p) - 1 + i]
            lp = comp.logprobs[i]
            assert tok in lp
            for t, value in lp.items():
                assert math.isclose(value, row[t].item(), abs_tol=2e-4), (i, t, value, row[t])
                checked += 1
    assert checked >= num_prompts * tokens * 3
