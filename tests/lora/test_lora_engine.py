"""Greedy output with LoRA adapters equals transformers + PEFT token for token (float32, cpu): a
batch mixing 4 adapters (ranks 4-64, attention-only, MLP-only, rsLoRA, rank/alpha patterns) and
the base model, with fewer device slots and host copies than adapters, in every scheduling mode;
prefix caching never shares KV blocks between adapters; adapters load and unload while requests
run."""
from __future__ import annotations

import pytest

from lora_helpers import (ATTENTION_TARGETS, DENSE_TARGETS, MAX_TOKENS, hf_lora_greedy,
                          lora_prompts, make_adapter)
from pagedllm import LLM, LoRARequest, SamplingParams

ADAPTERS = {  # name -> make_adapter arguments
    "all8": dict(targets=DENSE_TARGETS, r=8, alpha=16, seed=1),
    "attn16": dict(targets=("q_proj", "v_proj"), r=16, alpha=8, seed=2),
    "mlp4_rslora": dict(targets=("gate_proj", "up_proj", "down_proj"), r=4, alpha=8, seed=3,
                        use_rslora=True),
    "patterns64": dict(targets=DENSE_TARGETS, r=64, alpha=32, seed=4,
                       rank_pattern={"o_proj": 16}, alpha_pattern={"q_proj": 96}),
}
MODES = {  # "prefix_caching" runs twice: plain, then hitting the cache
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16,
                            max_num_seqs=4),
    "preempt_recompute": dict(num_gpu_blocks_override=12, preemption_mode="recompute"),
    "preempt_swap": dict(num_gpu_blocks_override=12, preemption_mode="swap"),
    "prefix_caching": dict(enable_prefix_caching=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(checkpoint_factory, tmp_path_factory):
    """(base path, {name: LoRARequest}, {name or None: transformers + PEFT tokens per prompt})."""
    base = checkpoint_factory("llama")
    root = tmp_path_factory.mktemp("adapters")
    requests, reference = {}, {None: hf_lora_greedy(base, None, lora_prompts())}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        path = make_adapter(base, str(root / name), **kwargs)
        requests[name] = LoRARequest(name, i + 1, path)
        reference[name] = hf_lora_greedy(base, path, lora_prompts())
    for name in ADAPTERS:  # every adapter changes the base model's tokens
        assert reference[name] != reference[None], name
    return base, requests, reference


def _engine(base: str, **kwargs) -> LLM:
    small = dict(max_model_len=128, max_num_batched_tokens=128, max_num_seqs=32)  # quick warm-up
    return LLM(base, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=64,
               **{"max_loras": 2, "max_cpu_loras": 2, **small, **kwargs})


def _mixed(requests: dict) -> tuple[list[dict], list, list]:
    """Every prompt with every adapter and with none, interleaved: (prompts, loras, keys)."""
    ps, loras, keys = [], [], []
    for i, p in enumerate(lora_prompts()):
        for name in [None, *ADAPTERS]:
            ps.append({"prompt_token_ids": p})
            loras.append(requests[name] if name else None)
            keys.append((name, i))
    return ps, loras, keys


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_batch_matches_transformers_peft(setup, mode: str) -> None:
    base, requests, reference = setup
    llm = _engine(base, **MODES[mode])
    manager = llm.llm_engine.executor.worker.lora_manager
    seen: list[int] = []
    prepare = manager.prepare

    def recording_prepare(batch):  # distinct adapters the workers saw in each step
        seen.append(len({s.lora_request.lora_int_id for s in batch.seqs if s.lora_request}))
        prepare(batch)

    manager.prepare = recording_prepare
    try:
        ps, loras, keys = _mixed(requests)
        outs = llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
        for (name, i), out in zip(keys, outs):
            assert list(out.outputs[0].token_ids) == reference[name][i], (name, i)
        assert max(seen) == 2  # max_loras: never more adapters in a step than slots
        assert manager.num_slot_fills >= 4 and manager.num_loads >= 4  # 4 adapters, 2 slots
        stats = llm.llm_engine.stats()
        if mode.startswith("preempt"):
            assert stats.num_preemptions > 0
        if mode == "prefix_caching":  # a second pass hits the cache, adapter by adapter
            hits = llm.llm_engine.block_manager.num_prefix_hit_blocks
            outs = llm.generate(ps, GREEDY, lora_request=loras, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == \
                [reference[name][i] for name, i in keys]
            assert llm.llm_engine.block_manager.num_prefix_hit_blocks > hits
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    finally:
        llm.shutdown()


def test_prefix_cache_never_shares_blocks_between_adapters(setup) -> None:
    base, requests, reference = setup
    llm = _engine(base, enable_prefix_caching=True)
    bm = llm.llm_engine.block_manager
    p = lora_prompts()[3]  # 40 tokens: 2 full blocks
    try:
        def run(name):
            out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False,
                               lora_request=requests[name] if name else None)
            assert list(out[0].outputs[0].token_ids) == reference[name][3], name
            return bm.num_prefix_hit_blocks

        hits = run("all8")
        for name in ("attn16", None, "mlp4_rslora"):  # the same prompt, other adapters: no hit
            assert run(name) == hits, name
        assert run("all8") == hits + 2  # the same adapter again: both full blocks hit
        assert run(None) == hits + 4
    finally:
        llm.shutdown()


def test_adapters_load_and_unload_while_requests_run(setup) -> None:
    base, requests, reference = setup
    llm = _engine(base, max_loras=2, max_cpu_loras=3)
    engine = llm.llm_engine
    ps = lora_prompts()
    try:
        assert engine.add_lora(requests["all8"]) and engine.list_loras() == {1}
        for i, p in enumerate(ps):
            engine.add_request(f"a{i}", {"prompt_token_ids": p}, GREEDY,
                               lora_request=requests["all8"])
        done = {}

        def step():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)

        for _ in range(3):
            step()
        # while all8's requests run: load attn16, unload all8, start requests of both and base
        assert engine.add_lora(requests["attn16"])
        assert engine.remove_lora(requests["all8"].lora_int_id)
        assert engine.list_loras() == {2}
        for i, p in enumerate(ps):
            engine.add_request(f"b{i}", {"prompt_token_ids": p}, GREEDY,
                               lora_request=requests["attn16"])
            engine.add_request(f"n{i}", {"prompt_token_ids": p}, GREEDY)
        step()
        engine.add_request("late", {"prompt_token_ids": ps[0]}, GREEDY,
                           lora_request=requests["all8"])  # unloaded, still by its path
        while engine.has_unfinished_requests():
            step()
        for i in range(len(ps)):
            assert done[f"a{i}"] == reference["all8"][i]
            assert done[f"b{i}"] == reference["attn16"][i]
            assert done[f"n{i}"] == reference[None][i]
        assert done["late"] == reference["all8"][0]
        assert engine.remove_lora(2) and engine.list_loras() == set()
    finally:
        llm.shutdown()


def test_attention_only_adapter_and_stats(setup, tmp_path) -> None:
    """An attention-only adapter (what the MoE families run) and vLLM's lora_requests_info."""
    base, requests, _ = setup
    path = make_adapter(base, str(tmp_path / "attn"), targets=ATTENTION_TARGETS, r=8, seed=9)
    want = hf_lora_greedy(base, path, lora_prompts()[:2])
    llm = _engine(base, max_loras=1)
    engine = llm.llm_engine
    try:
        req = LoRARequest("attn", 9, path)
        for i, p in enumerate(lora_prompts()[:2]):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY, lora_request=req)
        engine.add_request("other", {"prompt_token_ids": [5, 6, 7]}, GREEDY,
                           lora_request=requests["all8"])
        engine.step()
        stats = engine.stats()
        assert stats.running_lora_adapters == ["attn"] and stats.max_lora == 1
        assert stats.waiting_lora_adapters == ["all8"]  # one slot: it waits
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
        assert [got["0"], got["1"]] == want
    finally:
        llm.shutdown()


def test_logprobs_match_transformers_peft(setup) -> None:
    """The logprob of each greedy token (and its top 3) equals PEFT's log-softmax (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, requests, reference = setup
    req = requests["all8"]
    p = lora_prompts()[1]
    llm = _engine(base)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=3)
        out = llm.generate({"prompt_token_ids": p}, params, lora_request=req,
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == reference["all8"][1]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32), req.lora_path)
    with torch.no_grad():
        ids = torch.tensor([p + list(out.token_ids)])
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = lp[len(p) - 1 + i]
        for t, value in entry.items():
            got = value.logprob if hasattr(value, "logprob") else value
            assert abs(got - float(row[t])) < 1e-4, (i, t, got, float(row[t]))
        assert token in entry
