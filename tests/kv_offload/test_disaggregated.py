"""Disaggregated prefill with real processes on 127.0.0.1: a producer `pagedllm serve`, a
consumer `pagedllm serve` (SharedStorageConnector over a folder, P2pConnector over
torch.distributed, or LMCacheConnectorV1 over LMCache's shared-folder store where lmcache is
installed: the lmcache CI leg) and `pagedllm proxy` between
them, driven by the openai client. Outputs are a single engine's token for token; the consumer
loads the producer's blocks (its Prometheus metrics count them, its log shows hit rates);
killing the producer mid-run loses no request (the proxy counts the failed prefills)."""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "entrypoints"))
from cli_server import CliProcess, free_port  # noqa: E402

MAX_TOKENS = 8


def _lmcache_missing() -> str:
    """Why LMCache cannot run here ("" when it can): its engine test runs in the lmcache leg."""
    from pagedllm.kv_transfer.lmcache_worker import import_lmcache

    try:
        import_lmcache()
    except ImportError as exc:
        return f"lmcache is not importable: {exc}"
    return ""


# connector -> (the tier its loads are counted under, its kv_transfer_config but the role)
CONNECTORS = {
    "SharedStorageConnector": ("shared", lambda shared, port: {
        "kv_connector_extra_config": {"shared_storage_path": str(shared)}}),
    "P2pConnector": ("p2p", lambda shared, port: {
        "kv_parallel_size": 2, "kv_port": port, "kv_buffer_size": 1e7,
        "kv_connector_extra_config": {"retry_s": 0.5}}),
    # vLLM's name; LMCache's "fs" store: one file per chunk in a folder both engines share
    "LMCacheConnectorV1": ("lmcache", lambda shared, port: {"kv_connector_extra_config": {
        "lmcache.remote_storage_plugins": ["fs"],
        "lmcache.extra_config": {"remote_storage_plugin.fs.base_path": str(shared)}}}),
}


def _connector_params() -> list:
    missing = _lmcache_missing()
    return [pytest.param(name, marks=pytest.mark.skipif(
        bool(missing) and name == "LMCacheConnectorV1", reason=missing)) for name in CONNECTORS]


@pytest.fixture(scope="module", params=_connector_params())
def connector(request) -> str:
    return request.param


def _serve(model: str, role: str, connector: str, shared: Path, port: int,
           log: Path) -> CliProcess:
    transfer = {"kv_connector": connector, "kv_role": role,
                **CONNECTORS[connector][1](shared, port)}
    return CliProcess(["serve", model, "--device", "cpu", "--dtype", "float32", "--block-size",
                       "16", "--num-gpu-blocks-override", "128", "--disable-uvicorn-access-log",
                       "--kv-transfer-config", json.dumps(transfer)], log)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from pagedllm.testing.checkpoints import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("disagg-model")), "llama",
                           max_position_embeddings=512)


@pytest.fixture(scope="module")
def cluster(model, connector, tmp_path_factory):
    logs, shared = tmp_path_factory.mktemp("disagg-logs"), tmp_path_factory.mktemp("kv")
    port = free_port()
    producer = _serve(model, "kv_producer", connector, shared, port, logs / "producer.log")
    consumer = _serve(model, "kv_consumer", connector, shared, port, logs / "consumer.log")
    procs = [producer, consumer]
    try:
        producer.wait_ready()
        consumer.wait_ready()
        proxy = CliProcess(["proxy", "--prefill", producer.url, "--decode", consumer.url],
                     logs / "proxy.log")
        procs.append(proxy)
        proxy.wait_ready()
        yield producer, consumer, proxy
    finally:
        for p in procs:
            p.stop()


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 258) for _ in range(rng.randint(40, 100))] for _ in range(n)]


@pytest.fixture(scope="module")
def expected(model) -> dict[int, list[str]]:
    """What one engine answers, for the prompts of each test (seed -> texts): the reference."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=128)
    out = {}
    for seed, n in ((1, 4), (2, 6)):
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(seed, n)],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        out[seed] = [o.outputs[0].text for o in outs]
    llm.llm_engine.shutdown()
    return out


def _complete(url: str, prompt: list[int], stream: bool = False) -> str:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        model = c.models.list().data[0].id
        if not stream:
            return c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0.0).choices[0].text
        chunks = c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0, stream=True)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)


def _sample(metrics: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_proxy_outputs_equal_one_engine_with_transferred_kv(cluster, connector,
                                                            expected) -> None:
    producer, consumer, proxy = cluster
    tier = CONNECTORS[connector][0]
    prompts = _prompts(1, 4)
    got = [_complete(proxy.url, p) for p in prompts[:3]] + [_complete(proxy.url, prompts[3],
                                                                      stream=True)]
    assert got == expected[1]
    metrics = consumer.metrics()
    loaded = _sample(metrics, "pagedllm:kv_tier_hit_blocks_total", tier=tier)
    assert loaded == sum((len(p) - 1) // 16 for p in prompts), metrics[-3000:]
    assert _sample(metrics, "pagedllm:kv_tier_loaded_bytes_total", tier=tier) > 0
    assert _sample(metrics, "pagedllm:kv_transfer_latency_seconds_count") > 0
    assert _sample(proxy.metrics(), "pagedllm:proxy_prefill_failures_total") == 0


def test_killing_the_producer_loses_no_request(cluster, expected) -> None:
    producer, consumer, proxy = cluster
    prompts = _prompts(2, 6)
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            got[i] = _complete(proxy.url, prompts[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads[:3]:
        t.start()
    time.sleep(0.3)
    producer.kill()  # mid-run: some prefills done, some in flight, the rest find it gone
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == expected[2]
    assert _sample(proxy.metrics(), "pagedllm:proxy_prefill_failures_total") >= 3
    assert "prefill at" in proxy.logs() and "failed" in proxy.logs()
    consumer.stop()  # its engine logs the hit rates as it shuts down
    assert "KV prefix hits of" in consumer.logs()
