"""The memory-sizing forward (Worker.profile_run) stays inside what the scheduler can send."""
from __future__ import annotations

from pagedllm import LLM


def test_profile_run_sequences_fit_the_model_length(llama_path: str) -> None:
    # one sequence at most, so the 2048-token budget must not become one 2048-token sequence
    # (its positions would run past the rotary tables of a 64-token model)
    llm = LLM(llama_path, device="cpu", max_num_seqs=1, max_model_len=64, kv_cache_space_gib=0.01)
    worker = llm.llm_engine.executor.worker
    assert llm.llm_engine.config.scheduler.max_num_batched_tokens > 64
    worker.profile_run()
