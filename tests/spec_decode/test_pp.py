"""Speculation with pipeline_parallel_size=2 on the cpu (gloo, a worker process per stage): the
verification batches cross both stages, the last stage verifies and runs the proposer (a draft
model, or an EAGLE-3 head whose target embedding it loads and whose target states the first
stage sends on), two virtual engines keep two batches in flight, and greedy output is the
single-process plain engine's token for token (with preemption by swapping, and chunked
prompts), with no block left behind."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.checkpoints import eagle_config, random_eagle_state, save_eagle

pytestmark = pytest.mark.timeout(900)
# greedy continuations of the tiny llama that fall into short cycles: n-gram drafts get accepted
PROMPTS = [[5, 17, 99, 3, 42, 8, 8, 11, 250], [7, 7, 7, 8, 9, 7, 7, 7, 8],
           list(range(3, 40)), [100, 101, 102, 100, 101, 102, 100]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", num_gpu_blocks_override=128, block_size=4)
# speculate in every step (the adaptive guard picks by measured speed: not deterministic)
ALWAYS = {"disable_by_batch_size": 8}

Launch = tuple[int, int, tuple[tuple[int, int, tuple[int, ...]], ...]]


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _record(llm: LLM, method: str) -> list[Launch]:
    """Every batch the engine's executor runs, as (virtual engine, batches already in flight,
    the drafts it verifies: (seq id, position, drafts) each)."""
    engine = llm.llm_engine
    launches: list[Launch] = []
    run = getattr(engine.executor, method)

    def record(batch):  # noqa: ANN001, ANN202
        engines = getattr(engine.stepper, "engines", None)
        drafts = tuple((s.seq_id, s.start_pos, tuple(s.token_ids[-s.num_spec_tokens:]))
                       for s in batch.seqs if s.num_spec_tokens)
        launches.append((batch.virtual_engine,
                         len(engines.in_flight) if engines is not None else 0, drafts))
        return run(batch)

    setattr(engine.executor, method, record)
    return launches


@pytest.fixture(scope="module")
def want(llama_path: str) -> list[list[int]]:
    plain = LLM(llama_path, **ENGINE)
    try:
        return _tokens(plain)
    finally:
        plain.llm_engine.shutdown()


# per method, beside ENGINE: the self-draft's caches too small for all four sequences (they
# preempt each other by swapping, the proposer's KV swapped per virtual engine with the
# target's); the EAGLE-3 head's prompts chunked (a chunk's last target state waits for the next)
FEATURES = {"draft_model": dict(num_gpu_blocks_override=30, preemption_mode="swap",
                                swap_space=1),
            "eagle3": dict(enable_chunked_prefill=True, max_num_batched_tokens=8,
                           max_num_seqs=4)}


def _spec(method: str, llama_path: str, tmp_path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1, **ALWAYS}
    if method == "draft_model":  # the target drafting for itself: every draft accepted
        return {"model": llama_path, "num_speculative_tokens": 3, **ALWAYS}
    from transformers import AutoConfig

    # a random EAGLE-3 head reading the inputs of layers 0 and 1, both made on the first stage
    # (its drafts are rejected; the output is exact all the same)
    cfg = eagle_config(AutoConfig.from_pretrained(llama_path), 3, draft_vocab_size=128,
                       aux_layer_ids=[0, 1, 1])
    path = save_eagle(str(tmp_path / method), cfg, random_eagle_state(cfg, 3, std=0.2))
    return {"method": method, "model": path, "num_speculative_tokens": 3, **ALWAYS}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_pp2_matches_plain(method: str, llama_path: str, want: list[list[int]],
                           tmp_path) -> None:
    spec = _spec(method, llama_path, tmp_path)
    engine_args = {**ENGINE, **FEATURES.get(method, {})}
    single_drafts = None
    if method == "eagle3":  # the head's drafts with one stage, to compare with two
        single = LLM(llama_path, speculative_config=spec, **engine_args)
        launches = _record(single, "execute")
        assert _tokens(single) == want
        single.llm_engine.shutdown()
        single_drafts = {d for _, _, drafts in launches for d in drafts}
    llm = LLM(llama_path, pipeline_parallel_size=2, speculative_config=spec, **engine_args)
    engine = llm.llm_engine
    launches = _record(llm, "submit")
    try:
        assert type(engine.stepper).__name__ == "PipelinedSpecStepper"
        assert engine.config.speculative_config.method == method
        assert _tokens(llm) == want
        m = engine.stepper.metrics
        assert m.num_draft_tokens > 0, "no draft was verified"
        if method in ("ngram", "draft_model"):
            assert m.num_accepted_tokens > 0
        if method == "draft_model":  # its KV intact through the swaps
            assert m.num_accepted_tokens == m.num_draft_tokens
            assert sum(s.num_preemptions for s in engine.schedulers) > 0
        # both virtual engines verified drafts, with the other's batch in the stages
        verifying = [(ve, n) for ve, n, drafts in launches if drafts]
        assert {ve for ve, _ in verifying} == {0, 1}
        assert max(n for _, n in verifying) == 1
        if single_drafts is not None:  # the target states and embedding reached the head
            assert {d for _, _, drafts in launches for d in drafts} == single_drafts
        for s in engine.schedulers:  # every block back in its pool, no sequence state
            bm = s.block_manager
            assert bm.device.num_free + bm.device.num_cached_idle == bm.num_device_blocks
            assert bm.num_tracked_seqs() == 0
            assert bm.host.num_free == bm.num_host_blocks
    finally:
        engine.shutdown()
