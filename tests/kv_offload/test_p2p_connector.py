"""P2pConnector between two real engine processes on 127.0.0.1: a producer process computes
the prompts (one token each) and keeps their blocks; the consumer (this process) loads them
over its gloo group instead of computing them, its greedy output token for token a single
engine's. The producer killed mid-run: every request still completes (computed here), the
failures counted, every block accounted for. Config errors name the field."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

BS = 16


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (70, 49, 90, 33, 81, 64)]


def _transfer(role: str, port: int, **extra: object) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role, "kv_rank": int(role ==
            "kv_consumer"), "kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": port,
            "kv_buffer_size": 1e6, "kv_connector_extra_config": {"timeout_s": 5, **extra}}


def _engine(path: str, transfer: dict | None):  # noqa: ANN202
    from pagedllm import LLM

    return LLM(path, device="cpu", dtype="float32", block_size=BS, seed=0,
               num_gpu_blocks_override=64, kv_transfer_config=transfer)


def _greedy(llm, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:  # noqa: ANN001
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class Producer:
    """This file run as a script: a producer engine computes ``prompts`` (one token each),
    says READY, and serves their blocks until stdin closes."""

    def __init__(self, path: str, port: int, prompts: list[list[int]]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps({"path": path, "port": port,
                                                   "prompts": prompts})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            text=True)
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.proc.stdout.readline()
            if line.strip() != "READY":
                self.proc.kill()
                raise RuntimeError(f"producer: {line}{self.proc.communicate()[1][-3000:]}")
            self.ready = True

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def producer(llama_path):
    """One producer for the module (it starts while ``expected`` runs); the last test kills
    it."""
    port = _free_port()
    prod = Producer(llama_path, port, _prompts())
    yield prod, port
    prod.stop()


@pytest.fixture(scope="module")
def expected(llama_path, producer) -> list[list[int]]:
    single = _engine(llama_path, None)
    out = _greedy(single, _prompts())
    single.llm_engine.shutdown()
    producer[0].wait_ready()
    return out


def _counters(llm) -> dict:  # noqa: ANN001
    return llm.llm_engine.stats().kv_transfer["counters"]


def test_consumer_loads_the_producers_blocks(llama_path, producer, expected) -> None:
    port = producer[1]
    prompts = _prompts()
    consumer = _engine(llama_path, _transfer("kv_consumer", port))
    try:
        assert _greedy(consumer, prompts) == expected
        counters = _counters(consumer)
        # a hit never covers the last token: (len - 1) // BS blocks of each prompt
        assert counters["loaded:p2p"] == sum((len(p) - 1) // BS for p in prompts), counters
        assert counters.get("failed:p2p", 0) == 0
        assert consumer.llm_engine.kv.check_idle() == []
    finally:
        consumer.llm_engine.shutdown()


def test_producer_killed_mid_run_loses_no_request(llama_path, producer, expected) -> None:
    prod, port = producer
    prompts = _prompts()
    consumer = _engine(llama_path, _transfer("kv_consumer", port, retry_s=60))
    try:
        assert _greedy(consumer, prompts[:2]) == expected[:2]  # loaded while it lives
        connector = consumer.llm_engine.kv.connectors[0]
        locate = connector.locate

        def locate_then_kill(key):  # noqa: ANN001, ANN202
            found = locate(key)
            if found is not None and prod.proc.poll() is None:
                prod.kill()  # found in the directory, gone before the transfer
            return found

        connector.locate = locate_then_kill
        assert _greedy(consumer, prompts[2:]) == expected[2:]  # computed here instead
        counters = _counters(consumer)
        assert counters["loaded:p2p"] == sum((len(p) - 1) // BS for p in prompts[:2])
        assert counters["failed:p2p"] > 0, counters
        stats = consumer.llm_engine.stats().kv_transfer["P2pConnector"]["p2p"]
        assert stats["failed"] == counters["failed:p2p"] and stats["lost"] == 1, stats
        assert not stats["connected"]
        assert consumer.llm_engine.kv.check_idle() == []
        assert consumer.llm_engine.has_unfinished_requests() is False
    finally:
        consumer.llm_engine.shutdown()


def _settings(**fields: object) -> dict:
    from pagedllm.kv_transfer.config import KVTransferConfig
    from pagedllm.kv_transfer.p2p import P2pConnector

    base = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer", "kv_parallel_size": 2}
    cfg = KVTransferConfig(**{**base, **fields})
    return P2pConnector.worker_spec(SimpleNamespace(kv_transfer_config=cfg))


def test_config_errors_name_the_field() -> None:
    assert _settings()["rank"] == 1 and _settings(kv_role="kv_producer")["rank"] == 0
    cases = [
        ({"kv_role": "kv_both"}, "kv_role='kv_both' is not supported by P2pConnector"),
        ({"kv_rank": 0}, "kv_rank=0 is invalid.*0 for kv_producer, 1 for kv_consumer"),
        ({"kv_role": "kv_producer", "kv_rank": 1}, "kv_rank=1 is invalid"),
        ({"kv_parallel_size": 3}, "kv_parallel_size=3 is invalid.*must be 2"),
        ({"kv_port": 70000}, "kv_port=70000 is invalid.*1-65535"),
        ({"kv_buffer_size": 0}, "kv_buffer_size=0 is invalid: must be > 0"),
        ({"kv_buffer_device": "cuda"}, "kv_buffer_device='cuda' is not supported.*cpu"),
        ({"kv_connector_extra_config": {"timeout": 1}}, "unknown key.*timeout.*known: "
                                                        "timeout_s, retry_s"),
        ({"kv_connector_extra_config": {"timeout_s": -1}}, "timeout_s=-1 is invalid"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            _settings(**fields)


def test_engine_refuses_bad_config_and_busy_port(llama_path) -> None:
    import socket

    from pagedllm.kv_transfer import registry
    from pagedllm.kv_transfer.p2p import P2pConnector

    assert registry.resolve_connector("PyNcclConnector") is P2pConnector  # vLLM's name
    with pytest.raises(ValueError, match="kv_role='kv_both' is not supported by P2pConnector"):
        _engine(llama_path, {**_transfer("kv_producer", 1), "kv_role": "kv_both"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"kv_port={port}: the P2pConnector producer "
                                             "cannot serve"):
            _engine(llama_path, _transfer("kv_producer", port))
    with pytest.raises(ValueError, match="kv_buffer_size=100 is smaller than one block"):
        _engine(llama_path, {**_transfer("kv_producer", _free_port()), "kv_buffer_size": 100})


def test_producer_buffer_drops_the_oldest_save_and_unlists_it() -> None:
    """The worker stores in this process: a buffer of 2 blocks holds the last 2 saves (the
    scheduler side mirrors it and sends each key once); a dropped key leaves the directory,
    and a read of it fails naming the producer, while the others arrive bit for bit."""
    import torch

    from pagedllm.kv_transfer.base import KVStepOps
    from pagedllm.kv_transfer.config import KVTransferConfig
    from pagedllm.kv_transfer.p2p import Directory, P2pConnector
    from pagedllm.kv_transfer.p2p_worker import P2pConsumerStore, P2pProducerStore
    from pagedllm.kv_transfer.worker_side import CacheLayout

    layout, port = CacheLayout(num_layers=2, block_nbytes=64), _free_port()
    specs = {role: _settings(kv_role=role, kv_port=port, kv_buffer_size=2 * 128 + 5)
             for role in ("kv_producer", "kv_consumer")}
    cfg = KVTransferConfig(**_transfer("kv_producer", port))
    mirror = P2pConnector(SimpleNamespace(kv_transfer_config=cfg), {"p2p": 2})
    keys, ops = [bytes([i]) * 16 for i in range(3)], KVStepOps()
    for block, key in enumerate(keys + keys[2:]):
        mirror.on_computed(block, key, ops)
    assert [op[3] for op in ops.stores] == keys  # once each
    assert mirror.stats()["p2p"]["resident"] == 2 and mirror.stats()["p2p"]["slots"] == 2

    producer = P2pProducerStore(specs["kv_producer"], layout)
    consumer = P2pConsumerStore(specs["kv_consumer"], layout)
    directory = Directory(specs["kv_consumer"], 1)
    try:
        assert producer.num_slots == 2
        rows = torch.randint(0, 256, (3, 2, 64), dtype=torch.uint8)
        producer.write(keys[:2], rows[:2])
        producer.write(keys[2:], rows[2:])  # drops keys[0]
        assert [directory.holds(k) for k in keys] == [False, True, True]
        out = torch.zeros(2, 2, 64, dtype=torch.uint8)
        consumer.read(keys[1:], out)
        assert torch.equal(out, rows[1:])
        with pytest.raises(ValueError, match=f"producer at 127.0.0.1:{port} no longer holds "
                                             "1 of 2 blocks"):
            consumer.read(keys[:2], out)
    finally:
        directory.close()
        consumer.close()
        producer.close()


def _serve_as_producer(args: dict) -> None:
    llm = _engine(args["path"], _transfer("kv_producer", args["port"]))
    _greedy(llm, args["prompts"], max_tokens=1)  # the prefill instance: one token each
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes it
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    _serve_as_producer(json.loads(sys.argv[1]))
