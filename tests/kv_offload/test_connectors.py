"""KV connectors: --kv-transfer-config (vLLM's shape), connectors found by name and by entry
point, and the shared-storage connector between two engines: a producer's prompts are loaded by
a consumer instead of computed, with the consumer's greedy output token for token a single
engine's; missing or broken blocks are computed instead, counted."""
from __future__ import annotations

import random
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kv_transfer import registry
from pagedllm.kv_transfer.base import KVConnector
from pagedllm.kv_transfer.shared_storage import SharedStorageConnector

BS = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (70, 49, 90, 33)]


def _engine(path: str, role: str | None, shared: str, **kwargs: object) -> LLM:
    transfer = None if role is None else {
        "kv_connector": "SharedStorageConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": shared}}
    return LLM(path, device="cpu", dtype="float32", block_size=BS, seed=0,
               num_gpu_blocks_override=64, kv_transfer_config=transfer, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_consumer_loads_what_the_producer_computed(llama_path, tmp_path) -> None:
    prompts, shared = _prompts(), str(tmp_path / "kv")
    single = _engine(llama_path, None, shared)
    expected = _greedy(single, prompts)
    single.llm_engine.shutdown()

    producer = _engine(llama_path, "kv_producer", shared)
    _greedy(producer, prompts, max_tokens=1)  # the prefill instance: one token each
    saved = producer.llm_engine.stats().kv_transfer["counters"]["saved:shared"]
    assert saved == sum(len(p) // BS for p in prompts)  # every full prompt block, on return
    producer.llm_engine.shutdown()

    consumer = _engine(llama_path, "kv_consumer", shared)
    assert _greedy(consumer, prompts) == expected
    engine = consumer.llm_engine
    counters = engine.stats().kv_transfer["counters"]
    # a hit never covers the last token: (len - 1) // BS blocks of each prompt
    assert counters["loaded:shared"] == sum((len(p) - 1) // BS for p in prompts)
    assert engine.kv.check_idle() == []
    engine.shutdown()


def test_missing_or_broken_blocks_are_computed(llama_path, tmp_path) -> None:
    prompts, shared = _prompts(), tmp_path / "kv"
    producer = _engine(llama_path, "kv_producer", str(shared))
    expected, files = [], []
    for prompt in prompts:  # the producer computes everything itself; its files by prompt
        before = set(shared.iterdir()) if shared.exists() else set()
        expected += _greedy(producer, [prompt])
        files.append(sorted(set(shared.iterdir()) - before, key=lambda f: f.stat().st_mtime_ns))
    producer.llm_engine.shutdown()
    files[0][1].write_bytes(files[0][1].read_bytes()[:100])  # truncated: fails the size check
    files[1][2].unlink()  # gone: prompt 1 loads its first two blocks, computes the rest
    consumer = _engine(llama_path, "kv_consumer", str(shared))
    assert _greedy(consumer, prompts) == expected
    counters = consumer.llm_engine.stats().kv_transfer["counters"]
    assert counters.get("failed:shared", 0) > 0 and counters.get("loaded:shared", 0) > 0
    assert consumer.llm_engine.kv.check_idle() == []
    consumer.llm_engine.shutdown()


def test_offload_and_transfer_together(llama_path, tmp_path) -> None:
    """A consumer with its own disk tier: both connectors run, the output is unchanged."""
    prompts, shared = _prompts(), str(tmp_path / "kv")
    producer = _engine(llama_path, "kv_producer", shared)
    expected = _greedy(producer, prompts)
    producer.llm_engine.shutdown()
    consumer = _engine(llama_path, "kv_consumer", shared, kv_offload_disk=str(tmp_path / "d"),
                       kv_offload_disk_size=0.01)
    assert _greedy(consumer, prompts) == expected
    assert [c.name for c in consumer.llm_engine.kv.connectors] == [
        "OffloadingConnector", "SharedStorageConnector"]
    consumer.llm_engine.shutdown()


def test_transfer_config_parsing_and_names(tmp_path) -> None:
    args = EngineArgs(kv_transfer_config='{"kv_connector": "OffloadingConnector", "kv_role": '
                                         '"kv_both", "kv_connector_extra_config": '
                                         f'{{"kv_offload_disk": "{tmp_path}"}}}}')
    offload, transfer = args._kv_configs()
    assert transfer is None and offload.disk_path == str(tmp_path)
    with pytest.raises(ValueError, match="unknown key.*cpu_bytes"):
        EngineArgs(kv_transfer_config={"kv_connector": "OffloadingConnector",
                                       "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"cpu_bytes": 1}}
                   )._kv_configs()
    with pytest.raises(ValueError, match="'Nope' is not a known KV connector; known: "
                                         "OffloadingConnector, SharedStorageConnector, "
                                         "P2pConnector, PyNcclConnector, LMCacheConnector, "
                                         "LMCacheConnectorV1"):
        registry.resolve_connector("Nope")


class _ToyConnector(KVConnector):
    name = "Toy"
    worker_class = "pagedllm.kv_transfer.shared_storage_worker:SharedStorageWorker"

    def locate(self, key):  # noqa: ANN001, ANN201
        return None


def test_connectors_found_by_entry_point(monkeypatch) -> None:
    ep = EntryPoint("Toy", f"{__name__}:_ToyConnector", registry.ENTRY_POINT_GROUP)
    bad = EntryPoint("Bad", "pagedllm.kv_transfer.keys:block_key", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [ep, bad] if group == registry.ENTRY_POINT_GROUP else [])
    assert registry.resolve_connector("Toy") is _ToyConnector
    assert registry.connector_names()["Toy"] == f"{__name__}:_ToyConnector"
    with pytest.raises(TypeError, match="not a pagedllm.kv_transfer.base.KVConnector"):
        registry.resolve_connector("Bad")


def test_shared_storage_roles(tmp_path) -> None:
    from pagedllm.kv_transfer.base import KVStepOps
    from pagedllm.kv_transfer.config import KVTransferConfig

    def conn(role: str) -> SharedStorageConnector:
        cfg = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role=role,
                               kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
        return SharedStorageConnector(SimpleNamespace(kv_transfer_config=cfg), {})

    key = bytes(16)
    (tmp_path / f"{key.hex()}.r0.kv").write_bytes(b"x")
    assert conn("kv_producer").locate(key) is None  # producers never load
    assert conn("kv_consumer").locate(key) == ("shared", key)
    ops = KVStepOps()
    conn("kv_consumer").on_computed(3, bytes([1] * 16), ops)  # consumers never save
    producer = conn("kv_producer")
    producer.on_computed(3, key, ops)  # already there: not saved again
    producer.on_computed(4, bytes([1] * 16), ops)
    producer.on_computed(4, bytes([1] * 16), ops)  # once
    assert ops.stores == [("save", "shared", 4, bytes([1] * 16))]
