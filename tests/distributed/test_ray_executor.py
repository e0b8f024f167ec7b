"""The Ray executor on a local single-node cluster started here: TP=2 gives TP=1's tokens, and
a killed actor fails the engine fast. Skipped when Ray is not installed."""
from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from pagedllm import LLM  # noqa: E402
from pagedllm.distributed.errors import WorkerDiedError  # noqa: E402
from tp_utils import greedy  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ray_cluster():
    """A new local single-node cluster with room for two CPU ranks (never someone else's)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDLLM_WORKER_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("llama", {"num_key_value_heads": 1})])
def test_ray_tp2_matches_tp1(arch: str, overrides: dict, ray_cluster, checkpoint_factory,
                             tp1_tokens) -> None:
    expected = tp1_tokens(arch, overrides)
    llm = LLM(checkpoint_factory(arch, **overrides), device="cpu", dtype="float32",
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert greedy(llm) == expected
        llm.llm_engine.executor.check_health()
    finally:
        llm.llm_engine.shutdown()
    assert ray.is_initialized()  # the cluster we started stays; the executor only joined it


def test_ray_pp2_matches_pp1(ray_cluster, checkpoint_factory, tp1_tokens) -> None:
    """Pipeline stages as Ray actors: batches of both virtual engines in flight."""
    expected = tp1_tokens("qwen2", {})
    llm = LLM(checkpoint_factory("qwen2"), device="cpu", dtype="float32",
              pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert greedy(llm) == expected
        llm.llm_engine.executor.check_health()
    finally:
        llm.llm_engine.shutdown()


def test_ray_killed_actor_fails_fast(ray_cluster, checkpoint_factory) -> None:
    llm = LLM(checkpoint_factory("llama"), device="cpu", dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    engine = llm.llm_engine
    pids = list(engine.executor.pids)
    greedy(llm, max_tokens=2)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
        greedy(llm, max_tokens=50)
    assert time.monotonic() - start < 10
    engine.shutdown()
