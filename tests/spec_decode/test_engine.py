"""Speculative decoding end to end: greedy output with speculation is the plain engine's token
for token (which tests/engine checks against transformers), for n-gram, a draft model (the target
itself: every draft accepted; a smaller draft of the same family: most rejected) and EAGLE-1/3
heads, with chunked prefill, prefix caching, preemption (recompute and swap), n > 1, stops and
max_tokens inside an accepted run, logprobs, seeds, guided requests; and no block leaks."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.checkpoints import eagle_config, random_eagle_state, save_eagle

PROMPTS = [[5, 17, 99, 3, 42, 8, 8, 11, 250], [7, 7, 7, 8, 9, 7, 7, 7, 8],
           list(range(3, 40)), [100, 101, 102, 100, 101, 102, 100]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float32", num_gpu_blocks_override=160, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=512)


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def generate(llm: LLM, params: SamplingParams | list[SamplingParams],
             prompts: list[list[int]] = PROMPTS) -> list:
    outs = llm.generate(_ids(prompts), params, use_tqdm=False)
    assert_drained(llm)
    return outs


def assert_drained(llm: LLM) -> None:
    """Every block back in the pool (free or idle in the prefix cache), no sequence state."""
    bm = llm.llm_engine.block_manager
    assert bm.device.num_free + bm.device.num_cached_idle == bm.num_device_blocks
    assert bm.host.num_free == bm.num_host_blocks
    assert bm.num_tracked_seqs() == 0


def tokens(outs: list) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def heads(llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(llama_path)
    root = tmp_path_factory.mktemp("heads")
    c1 = eagle_config(target, 1)
    c3 = eagle_config(target, 3, draft_vocab_size=128, aux_layer_ids=[0, 1, 1])
    return {"eagle": save_eagle(str(root / "e1"), c1, random_eagle_state(c1, 1, std=0.2)),
            "eagle3": save_eagle(str(root / "e3"), c3, random_eagle_state(c3, 3, std=0.2))}


@pytest.fixture(scope="module")
def small_draft(checkpoint_factory) -> str:
    """A smaller Llama (one layer, hidden 32) with the target's tokenizer."""
    return checkpoint_factory("llama", num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, seed=7)


@pytest.fixture(scope="module")
def plain(llama_path: str) -> LLM:
    return LLM(llama_path, **ENGINE)


@pytest.fixture(scope="module")
def expected(plain: LLM) -> list[list[int]]:
    return tokens(generate(plain, GREEDY))


# speculate in every step (the adaptive guard would pick by measured speed: not deterministic)
ALWAYS = {"disable_by_batch_size": 64}


def _spec(method: str, llama_path: str, heads: dict, small_draft: str, k: int = 3) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1, **ALWAYS}
    if method == "draft_self":
        return {"model": llama_path, "num_speculative_tokens": k, **ALWAYS}
    if method == "draft_small":
        return {"model": small_draft, "num_speculative_tokens": k, **ALWAYS}
    return {"method": method, "model": heads[method], "num_speculative_tokens": k, **ALWAYS}


METHODS = ["ngram", "draft_self", "draft_small", "eagle", "eagle3"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain(method: str, llama_path: str, heads: dict, small_draft: str,
                             expected: list[list[int]]) -> None:
    llm = LLM(llama_path, speculative_config=_spec(method, llama_path, heads, small_draft),
              **ENGINE)
    assert tokens(generate(llm, GREEDY)) == expected
    metrics = llm.llm_engine.stepper.metrics
    assert metrics.num_draft_tokens > 0, "no draft was verified"
    if method == "draft_self":  # the target drafting for itself: every draft is accepted
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens
        assert metrics.mean_accepted_length > 3.5  # k + 1 = 4, but fewer near max_tokens


@pytest.mark.parametrize("mode,method", [("chunked_prefill", "eagle"),
                                         ("chunked_prefill", "draft_self"),
                                         ("prefix_caching", "draft_self"),
                                         ("prefix_caching", "eagle3"), ("recompute", "ngram"),
                                         ("recompute", "eagle"), ("swap", "draft_self")])
def test_modes(mode: str, method: str, llama_path: str, heads: dict, small_draft: str,
               expected: list[list[int]]) -> None:
    engine = dict(ENGINE)
    prompts, want = PROMPTS, expected
    if mode == "chunked_prefill":
        engine.update(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    elif mode == "prefix_caching":
        engine.update(enable_prefix_caching=True)
        prompts, want = PROMPTS + PROMPTS[:2], expected + expected[:2]
    else:  # a cache too small for all four at once: preemption
        engine.update(num_gpu_blocks_override=24, preemption_mode=mode, swap_space=1)
    llm = LLM(llama_path, speculative_config=_spec(method, llama_path, heads, small_draft),
              **engine)
    assert tokens(generate(llm, GREEDY, prompts)) == want
    if mode == "prefix_caching":  # a second pass hits the cache
        assert tokens(generate(llm, GREEDY, prompts)) == want
        assert llm.llm_engine.block_manager.num_prefix_hit_blocks > 0
    if mode in ("recompute", "swap"):
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_stops_inside_an_accepted_run(llama_path: str, plain: LLM) -> None:
    """max_tokens, a stop token and a stop string falling inside a run of accepted drafts end
    the output exactly where the plain engine ends it: no token past them."""
    llm = LLM(llama_path, speculative_config={"model": llama_path,
                                              "num_speculative_tokens": 4, **ALWAYS},
              **ENGINE)
    ref = generate(plain, GREEDY)
    stop_tok = ref[0].outputs[0].token_ids[6]
    text = ref[2].outputs[0].text
    cases = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]),
             SamplingParams(temperature=0.0, max_tokens=24, stop=[text[9:12]],
                            ignore_eos=True)]
    for params in cases:
        want = generate(plain, params)
        got = generate(llm, params)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, params
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert llm.llm_engine.stepper.metrics.num_accepted_tokens > 0


def test_logprobs_are_the_targets(llama_path: str, plain: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = LLM(llama_path, speculative_config={"model": llama_path,
                                              "num_speculative_tokens": 3, **ALWAYS},
              **ENGINE)
    want, got = generate(plain, params), generate(llm, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert set(lw) == set(lg)
            for t in lw:
                assert abs(lw[t].logprob - lg[t].logprob) < 1e-4
        assert abs(w.outputs[0].cumulative_logprob - g.outputs[0].cumulative_logprob) < 1e-3


def test_seeded_sampling_reproducible_and_n(llama_path: str) -> None:
    """Temperature > 0 with seeds: the same run twice gives the same tokens (whatever else is in
    the batch); n = 2 / best_of = 3 complete with their own tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1, **ALWAYS}
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, n=2, best_of=3, max_tokens=10,
                             ignore_eos=True)]
    llm = LLM(llama_path, speculative_config=spec, **ENGINE)
    first = tokens(generate(llm, params, PROMPTS[:2]))
    assert tokens(generate(llm, params, PROMPTS[:2])) == first
    alone = tokens(generate(llm, params[:1], PROMPTS[:1]))
    assert alone == first[:1]
    assert len(first) == 3 and [len(t) for t in first] == [16, 10, 10]


def test_guided_requests_advance_over_accepted_tokens(llama_path: str, plain: LLM) -> None:
    """A guided request beside speculating ones gets the plain engine's output (its grammar
    sees only tokens the target emitted)."""
    pytest.importorskip("xgrammar")
    from pagedllm.sampling_params import GuidedDecodingParams

    guided = SamplingParams(temperature=0.0, max_tokens=12,
                            guided_decoding=GuidedDecodingParams(choice=["yes", "no", "maybe"]))
    params = [guided, GREEDY, GREEDY]
    llm = LLM(llama_path, speculative_config={"model": llama_path,
                                              "num_speculative_tokens": 3, **ALWAYS},
              **ENGINE)
    want = generate(plain, params, PROMPTS[:3])
    got = generate(llm, params, PROMPTS[:3])
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert llm.llm_engine.stepper.metrics.num_accepted_tokens > 0


def test_disable_by_batch_size(llama_path: str, expected: list[list[int]]) -> None:
    """Four running with disable_by_batch_size=3: no speculation, and the draft model does not
    even follow the sequences (no proposer work); two running: it follows and speculates."""
    spec = {"model": llama_path, "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    llm = LLM(llama_path, speculative_config=spec, **ENGINE)
    stepper = llm.llm_engine.stepper
    skips: list[bool] = []
    execute = stepper.executor.execute

    def recording(batch):  # noqa: ANN001, ANN202
        skips.extend(s.proposer_skip for s in batch.seqs)
        return execute(batch)

    stepper.executor.execute = recording
    assert tokens(generate(llm, GREEDY)) == expected
    m = stepper.metrics
    assert m.num_plain_steps > 0 and m.num_draft_tokens == 0  # four running: never speculates
    assert skips and all(skips)
    skips.clear()
    assert tokens(generate(llm, GREEDY, PROMPTS[:2])) == expected[:2]
    assert m.num_draft_tokens > 0  # two running: speculates
    assert not any(skips)


def test_refusals_name_the_field(llama_path: str, checkpoint_factory) -> None:
    from types import SimpleNamespace

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.speculative import check_speculative

    config = EngineArgs(model=llama_path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
    caps = SimpleNamespace(multi_token_decode=None, prefix_caching=False, chunked_prefill=False,
                           static_shapes=False)
    with pytest.raises(ValueError, match="multi_token_decode"):
        check_speculative(config, SimpleNamespace(name="toy", capabilities=caps))
    caps.prefix_caching, caps.static_shapes = True, True
    from pagedllm.worker.worker import Worker  # pads nothing (the tpu worker: tests/backends)

    with pytest.raises(ValueError, match=r"static_shapes.*Worker.pads_verification_steps"):
        check_speculative(config, SimpleNamespace(name="toy", capabilities=caps,
                                                  worker_cls=lambda: Worker))
    caps.static_shapes = False
    config.parallel.pipeline_parallel_size = 2  # accepted (tests/spec_decode/test_pp.py)
    check_speculative(config, SimpleNamespace(name="toy", capabilities=caps))
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        LLM(llama_path, speculative_config={"method": "eagle", "num_speculative_tokens": 2},
            **ENGINE)
    other = checkpoint_factory("llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size=300"):
        LLM(llama_path, speculative_config={"model": other, "num_speculative_tokens": 2},
            **ENGINE)
