"""Greedy output with speculation equals the plain engine's for every registered family (tiny
random checkpoints): n-gram drafts, and the target as its own draft model (every draft
accepted: the multi-token verification path on each family's attention and rotary)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.testing.checkpoints import FAMILY_CONFIGS

FAMILIES = ["llama", "qwen2", "mistral", "opt", *FAMILY_CONFIGS]
PROMPTS = [[5, 17, 99, 3, 42, 8, 8, 11, 50], [7, 7, 7, 8, 9, 7, 7, 7, 8], list(range(3, 30))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ENGINE = dict(dtype="float32", num_gpu_blocks_override=96, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=256, max_model_len=256)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.device.num_free + bm.device.num_cached_idle == bm.num_device_blocks
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_family(family: str, checkpoint_factory) -> None:
    path = checkpoint_factory(family)
    want = _tokens(LLM(path, **ENGINE))
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1, "disable_by_batch_size": 64},
                 {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 64}):
        llm = LLM(path, speculative_config=spec, **ENGINE)
        assert _tokens(llm) == want, (family, spec.get("method", "draft_model"))
        assert llm.llm_engine.stepper.metrics.num_draft_tokens > 0


def test_length_switched_rotary_past_its_switch(checkpoint_factory) -> None:
    """Phi-3's LongRoPE switches factors at 70 tokens by the step's sequence length: verified
    drafts take their own length (as their decode steps would), not the chunk's end."""
    path = checkpoint_factory("phi3")
    prompts = [[(7 * i) % 250 + 3 for i in range(62)], [5] * 30 + list(range(3, 35))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    want = run(LLM(path, **ENGINE))
    llm = LLM(path, speculative_config={"model": path, "num_speculative_tokens": 4,
                                        "disable_by_batch_size": 64}, **ENGINE)
    assert run(llm) == want
    assert llm.llm_engine.stepper.metrics.num_accepted_tokens > 0
