"""KV offload tiers end to end: greedy output with a host tier, a disk tier or both equals
transformers' token for token (float32, a tiny random-weight Llama), with prefix hits actually
served from each tier (counted), through chunked prefill and preemption; every block is
accounted for at idle; failed disk reads are computed instead, counted, and change nothing."""
from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv_offload import stores
from pagedllm.testing.e2e import first_mismatch

BS = 16
MAX_TOKENS = 6
DOC_TOKENS = 4 * BS + 5  # 4 full blocks of document, then the question
ROW_GIB = 2 * 2 * BS * 2 * 16 * 4 / (1 << 30)  # one block of both layers: 8 KiB


def _workload() -> list[list[int]]:
    """6 documents, each asked 3 questions (distinct 7-token suffixes), shuffled."""
    rng = random.Random(45)
    docs = [[rng.randint(3, 258) for _ in range(DOC_TOKENS)] for _ in range(6)]
    prompts = [d + [rng.randint(3, 258) for _ in range(7)] for d in docs for _ in range(3)]
    rng.shuffle(prompts)
    return prompts


@pytest.fixture(scope="module")
def expected(llama_path: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in _workload()]


def _run(path: str, group: int = 2, **kwargs: object) -> tuple[list[list[int]], LLM]:
    """The workload ``group`` requests at a time on a device cache of 16 blocks (3 documents
    at most): documents are evicted before they are asked again."""
    llm = LLM(path, device="cpu", dtype="float32", block_size=BS, num_gpu_blocks_override=16,
              enable_prefix_caching=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts, out = _workload(), []
    for i in range(0, len(prompts), group):
        batch = [{"prompt_token_ids": p} for p in prompts[i:i + group]]
        out += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    return out, llm


def _loaded(llm: LLM) -> dict[str, int]:
    counters = llm.llm_engine.stats().kv_transfer["counters"]
    return {k.split(":")[1]: v for k, v in counters.items() if k.startswith("loaded:")}


def _check_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.check_idle() == []
    assert engine.block_manager.num_tracked_seqs() == 0
    engine.shutdown()


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_greedy_equals_transformers_with_hits_from_each_tier(llama_path, expected, tmp_path,
                                                             tiers) -> None:
    kwargs: dict = {}
    if "host" in tiers:  # host+disk: 12 blocks of host tier, the rest demoted to disk
        kwargs["kv_offload_size"] = 12 * ROW_GIB if "disk" in tiers else 0.01
    if "disk" in tiers:
        kwargs.update(kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    got, llm = _run(llama_path, **kwargs)
    assert got == expected, first_mismatch(got, expected)
    loaded = _loaded(llm)
    for tier in tiers.split("+"):
        assert loaded.get(tier, 0) > 0, f"no prefix hit was served from the {tier} tier: {loaded}"
    stats = llm.llm_engine.stats().kv_transfer
    rates = stats["hit_rates"]  # 12 of the 18 prompts repeat a 4-block document
    assert sum(rates.values()) == pytest.approx(12 * 4 / (18 * 4))
    assert stats["num_loads"] > 0 and stats["load_seconds_sum"] > 0
    if tiers == "host+disk":  # the host tier filled up and demoted its LRU blocks to disk
        assert stats["OffloadingConnector"]["host"]["evicted"] > 0
        assert stats["counters"]["saved:disk"] > 0 and stats["bytes"]["saved:disk"] > 0
    _check_idle(llm)
    if "disk" in tiers:  # the tier's file goes with the engine
        assert not list(tmp_path.iterdir())


def test_offload_serves_more_hits_than_the_device_alone(llama_path, tmp_path) -> None:
    _, plain = _run(llama_path)
    device_hits = plain.llm_engine.block_manager.num_prefix_hit_blocks
    plain.llm_engine.shutdown()
    _, offload = _run(llama_path, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    hits = offload.llm_engine.block_manager.num_prefix_hit_blocks
    # every repeated question finds its whole document: 12 repeats x 4 blocks
    assert hits == 12 * 4 > device_hits
    _check_idle(offload)


def test_chunked_prefill_and_preemption(llama_path, expected, tmp_path) -> None:
    """Six requests at a time through 16 blocks with 24-token chunks: sequences are preempted
    (recomputed) and come back through the tiers; the tiers survive it."""
    got, llm = _run(llama_path, group=6, enable_chunked_prefill=True,
                    max_num_batched_tokens=24, max_num_seqs=4, preemption_mode="recompute",
                    kv_offload_size=6 * ROW_GIB, kv_offload_disk=str(tmp_path),
                    kv_offload_disk_size=0.01)
    assert got == expected, first_mismatch(got, expected)
    engine = llm.llm_engine
    assert engine.stats().num_preemptions > 0
    assert sum(_loaded(llm).values()) > 0
    _check_idle(llm)


def test_failed_disk_reads_are_computed_instead(llama_path, expected, tmp_path,
                                                monkeypatch) -> None:
    """Every other disk read fails: those blocks are computed, the failures are counted and
    logged, the output is still transformers'."""
    real_read = stores.DiskStore.read
    calls = {"n": 0}

    def flaky_read(self, slots, out):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] % 2:
            raise OSError("simulated disk read error")
        return real_read(self, slots, out)

    monkeypatch.setattr(stores.DiskStore, "read", flaky_read)
    got, llm = _run(llama_path, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    assert got == expected, first_mismatch(got, expected)
    counters = llm.llm_engine.stats().kv_transfer["counters"]
    assert counters.get("failed:disk", 0) > 0 and counters.get("loaded:disk", 0) > 0
    _check_idle(llm)


def test_worker_in_its_own_process(llama_path, expected, tmp_path) -> None:
    """The tiers live beside the worker: with the worker in a process of its own (the
    multiprocess executor) the moves travel in each step and the output is the same."""
    got, llm = _run(llama_path, distributed_executor_backend="mp",
                    kv_offload_size=12 * ROW_GIB, kv_offload_disk=str(tmp_path),
                    kv_offload_disk_size=0.01)
    assert got == expected, first_mismatch(got, expected)
    assert set(_loaded(llm)) == {"host", "disk"}
    _check_idle(llm)


def _steps_to_first_token(llm: LLM, prompt: list[int]) -> int:
    """Engine steps from adding ``prompt`` until its first token is out (then it finishes)."""
    engine = llm.llm_engine
    engine.add_request("probe", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    steps, first = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if first is None and any(o.request_id == "probe" and o.outputs[0].token_ids
                                 for o in outs):
            first = steps
    assert first is not None
    return first


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_host_tier_hit_is_admitted_in_the_step_that_loads_it(llama_path, tmp_path,
                                                              tier) -> None:
    """The host tier's loads cannot fail, so they run before the step's forward and the
    request is admitted at once: its first token comes as soon as with the document on the
    device. A disk load may fail: the request waits one step for it to land."""
    kwargs: dict = ({"kv_offload_size": 0.01} if tier == "host" else
                    {"kv_offload_disk": str(tmp_path), "kv_offload_disk_size": 0.01})
    llm = LLM(llama_path, device="cpu", dtype="float32", block_size=BS,
              num_gpu_blocks_override=16, enable_prefix_caching=True, seed=0, **kwargs)
    rng = random.Random(7)
    docs = [[rng.randint(3, 258) for _ in range(DOC_TOKENS)] for _ in range(6)]
    cold = _steps_to_first_token(llm, docs[0] + [5, 6, 7])
    warm = _steps_to_first_token(llm, docs[0] + [8, 9, 10])  # on the device
    for doc in docs[1:]:  # 5 more documents push the first out of 16 blocks
        _steps_to_first_token(llm, doc + [5, 6, 7])
    before = sum(_loaded(llm).values())
    offloaded = _steps_to_first_token(llm, docs[0] + [11, 12, 13])
    assert sum(_loaded(llm).values()) - before == 4, "the document did not come from the tier"
    assert warm == cold
    assert offloaded == warm + (0 if tier == "host" else 1)
    _check_idle(llm)


def test_a_host_tier_hit_waits_for_no_save(llama_path) -> None:
    """Blocks are written through to the host tier after the step that computed them, so the
    device blocks a host-tier hit evicts to make room are in the host tier already: the step
    that loads the hit carries no save (on a GPU its load would wait for their copy)."""
    llm = LLM(llama_path, device="cpu", dtype="float32", block_size=BS,
              num_gpu_blocks_override=16, enable_prefix_caching=True, seed=0,
              kv_offload_size=0.01)
    engine = llm.llm_engine
    counters = engine.kv.manager.counters
    rng = random.Random(11)
    docs = [[rng.randint(3, 258) for _ in range(DOC_TOKENS)] for _ in range(6)]
    for doc in docs:  # the last 5 push the first out of the 16 device blocks
        _steps_to_first_token(llm, doc + [5, 6, 7])
    assert counters["saved:host"] > 0
    engine.add_request("probe", {"prompt_token_ids": docs[0] + [11, 12, 13]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    load_steps = 0
    while engine.has_unfinished_requests():
        loaded, saved = counters["loaded:host"], counters["saved:host"]
        engine.step()
        if counters["loaded:host"] > loaded:
            load_steps += 1
            assert counters["saved:host"] == saved, "the loading step saved evicted blocks"
    assert load_steps == 1
    _check_idle(llm)
