"""Speculation with tensor_parallel_size=2 on the cpu (gloo, a worker process per rank): the
target and the draft model (or EAGLE-3 head) are sharded over the ranks (one KV head each),
every rank verifies, and greedy output is the single-process plain engine's."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)
PROMPTS = [[5, 17, 99, 3, 42, 8, 8, 11, 250], [7, 7, 7, 8, 9, 7, 7, 7, 8]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_tp2_matches_plain(method: str, llama_path: str, tmp_path) -> None:
    plain = LLM(llama_path, device="cpu", dtype="float32", num_gpu_blocks_override=64)
    want = _tokens(plain)
    plain.llm_engine.shutdown()
    model = llama_path
    if method == "eagle3":  # a random EAGLE-3 head: drafts rejected, output still exact
        from transformers import AutoConfig

        from pagedllm.spec_decode.checkpoints import eagle_config, random_eagle_state, save_eagle

        cfg = eagle_config(AutoConfig.from_pretrained(llama_path), 3, draft_vocab_size=128,
                           aux_layer_ids=[0, 1, 1])
        model = save_eagle(str(tmp_path / "e3"), cfg, random_eagle_state(cfg, 3, std=0.2))
    llm = LLM(llama_path, device="cpu", dtype="float32", num_gpu_blocks_override=64,
              tensor_parallel_size=2,
              speculative_config={"model": model, "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 8})
    try:
        assert llm.llm_engine.config.speculative_config.method == method
        assert _tokens(llm) == want
        m = llm.llm_engine.stepper.metrics
        assert m.num_draft_tokens > 0
        if method == "draft_model":  # the target drafting for itself, sharded alike
            assert m.num_accepted_tokens == m.num_draft_tokens
    finally:
        llm.llm_engine.shutdown()
