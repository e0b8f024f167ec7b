"""Pipeline parallelism on the cpu (gloo, one worker process per rank): PP=2 and PP=2 x TP=2 give
the single-process engine's greedy tokens on every architecture, plain and with prefix caching,
chunked prefill and preemption by swapping; each stage holds only its layers; bad splits and
backends without pipeline support are refused before any worker starts."""
from __future__ import annotations

import multiprocessing
import re
import types

import pytest
import torch

from pagedllm import LLM
from pagedllm.distributed.parallel_state import PPGroup
from pagedllm.engine.config_validation import check_pipeline_parallel
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.config import ParallelConfig
from pagedllm.models.layers.pipeline import PPMissingLayer, get_pp_indices, partition_layers
from tp_utils import MAX_TOKENS, greedy

pytestmark = pytest.mark.timeout(600)

ARCHS = ["llama", "qwen2", "opt"]
# as test_tensor_parallel's FEATURES (so the PP=1 reference is shared), but 6 blocks in all:
# 3 per virtual engine, too few for its sequences, so they preempt each other by swapping
FEATURES = dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                preemption_mode="swap")
FEATURE_TOKENS = 20


# --- the layer split --------------------------------------------------------------------
@pytest.mark.parametrize("layers,stages,counts", [
    (2, 2, [1, 1]), (4, 2, [2, 2]), (3, 2, [2, 1]), (7, 3, [2, 3, 2]), (5, 4, [1, 1, 2, 1]),
    (5, 1, [5]),
])
def test_even_split(layers: int, stages: int, counts: list[int]) -> None:
    assert partition_layers(layers, stages) == counts
    bounds = [get_pp_indices(layers, r, stages) for r in range(stages)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap


def test_partition_override() -> None:
    assert [get_pp_indices(4, r, 2, (3, 1)) for r in range(2)] == [(0, 3), (3, 4)]
    assert ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="mp",
                          pp_layer_partition="3, 1").pp_layer_partition == (3, 1)  # CLI spelling


@pytest.mark.parametrize("counts,match", [
    ([3, 2], "covers 5 layers but the model has 4"), ([4], "names 1 stages"),
    ([4, 0], "each an integer >= 1"),
])
def test_bad_partition_override(counts: list[int], match: str) -> None:
    with pytest.raises(ValueError,
                       match=re.escape(f"pp_layer_partition={counts!r} is invalid") + f".*{match}"):
        partition_layers(4, 2, counts)


@pytest.mark.parametrize("value,match", [("a,b", "each an integer >= 1"), ((4,), "names 1 stages"),
                                         ((2, 0), "each an integer >= 1")])
def test_bad_partition_argument(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=f"pp_layer_partition=.* is invalid: .*{match}"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=value)


def test_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is larger than the model's 2"):
        partition_layers(2, 3)


# --- refusals ---------------------------------------------------------------------------
def test_backend_without_pipeline_support_is_refused(checkpoint_factory) -> None:
    config = EngineArgs(model=checkpoint_factory("llama"), device="cpu",
                        pipeline_parallel_size=2).create_engine_config()
    backend = types.SimpleNamespace(name="tpu",
                                    capabilities=types.SimpleNamespace(pipeline_parallel=False))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: the tpu backend does not "
                                         "support pipeline parallelism.*backends that do: .*cpu"):
        check_pipeline_parallel(config, backend)


def test_model_without_stages_is_refused(checkpoint_factory, monkeypatch) -> None:
    """An architecture whose model class builds all its layers (no make_layers) is refused."""
    from pagedllm.backends.registry import resolve_backend
    from pagedllm.models import registry

    monkeypatch.setattr(registry, "model_class", lambda arch: type("Unstaged", (), {}))
    config = EngineArgs(model=checkpoint_factory("llama"), device="cpu",
                        pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="LlamaForCausalLM does not run as pipeline stages"):
        check_pipeline_parallel(config, resolve_backend("cpu"))


def test_bad_sizes_are_refused_before_spawning(checkpoint_factory) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 is invalid"):
        EngineArgs(model=checkpoint_factory("llama"), pipeline_parallel_size=0
                   ).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' is invalid"):
        EngineArgs(model=checkpoint_factory("llama"), pipeline_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        LLM(checkpoint_factory("llama"), device="cpu", pipeline_parallel_size=3)
    assert set(multiprocessing.active_children()) <= before


# --- a stage holds only its layers --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_stage_holds_only_its_layers(arch: str, checkpoint_factory) -> None:
    """Stage 1 of 2 of a 3-layer model split 1,2: layers 1-2's weights and KV caches only, no
    embedding unless the LM head is tied to it; loading skips the other stage's tensors."""
    from pagedllm.backends.registry import resolve_backend

    config = EngineArgs(model=checkpoint_factory(arch, num_hidden_layers=3), device="cpu",
                        dtype="float32", pipeline_parallel_size=2, pp_layer_partition=[1, 2],
                        num_gpu_blocks_override=8).create_engine_config()
    backend = resolve_backend("cpu")
    backend.check_and_update_config(config)
    stage = {}
    for rank in range(2):
        worker = backend.worker_cls()(config, backend, rank=rank, pp=PPGroup(rank=rank, size=2))
        worker.load_model()
        stage[rank] = worker
    first, last = stage[0].model, stage[1].model
    assert [isinstance(m, PPMissingLayer) for m in first.layers] == [False, True, True]
    assert [isinstance(m, PPMissingLayer) for m in last.layers] == [True, False, False]
    assert not any(".1." in n or ".2." in n for n, _ in first.named_parameters())
    assert isinstance(first.lm_head, PPMissingLayer)
    tied = arch != "llama"  # the qwen2 and opt checkpoints tie the LM head to the embedding
    assert isinstance(last.embed_tokens, PPMissingLayer) != tied
    num_blocks, _ = stage[1].determine_num_blocks()
    assert num_blocks == 8 // 2  # the blocks are shared among the 2 virtual engines
    stage[1].after_cache_init = lambda: None  # its warm-up step would wait for stage 0
    stage[1].init_cache(num_blocks, 0)
    assert [len(c) for c in stage[1].ve_kv_caches] == [2, 2]  # per virtual engine: its layers
    assert stage[1].ve_kv_caches[0][0].shape[1] == num_blocks


# --- equality with the single-process engine -------------------------------------------------
# the Llama-derived families run as stages through LlamaForCausalLM (swapped attention, MoE MLP,
# fused checkpoint tensors)
DERIVED = ["qwen3", "mixtral", "phi3"]
PLAIN_CASES = ([pytest.param(a, 1, id=f"{a}-pp2") for a in ARCHS + DERIVED]
               + [pytest.param(a, 2, id=f"{a}-pp2xtp2") for a in ARCHS])


@pytest.mark.parametrize("arch,tp", PLAIN_CASES)
def test_pp2_matches_pp1(arch: str, tp: int, checkpoint_factory, tp1_tokens) -> None:
    expected = tp1_tokens(arch, {})
    llm = LLM(checkpoint_factory(arch), device="cpu", dtype="float32", pipeline_parallel_size=2,
              tensor_parallel_size=tp)
    engine = llm.llm_engine
    workers = [w.process for w in engine.executor.workers]
    try:
        assert engine.config.parallel.distributed_executor_backend == "mp"
        assert len(engine.schedulers) == 2 and len(workers) == 2 * tp
        assert type(engine.stepper).__name__ == "PipelinedStepper"
        assert greedy(llm) == expected
        # every rank ran every step (its own steps' spans, for benchmarks/pp_timeline.py): the
        # 3 requests split over the 2 virtual engines, each runs its own 8 steps (+ the cpu
        # worker's warm-up step)
        timelines = engine.executor.stage_timelines()
        assert [len(t) for t in timelines] == [2 * MAX_TOKENS + 1] * (2 * tp)
        assert all(a <= b for t in timelines for a, b in t)
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in workers)


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2xtp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_pp2_with_chunked_prefill_prefix_caching_and_swap(arch: str, tp: int, checkpoint_factory,
                                                          tp1_tokens) -> None:
    """Block moves (swap out/in, copy-on-write) reach every stage's cache of the right virtual
    engine; prefix-cache hits and chunked prompts cross the stages."""
    expected = tp1_tokens(arch, {}, FEATURE_TOKENS, num_gpu_blocks_override=4, **FEATURES)
    llm = LLM(checkpoint_factory(arch), device="cpu", dtype="float32", pipeline_parallel_size=2,
              tensor_parallel_size=tp, num_gpu_blocks_override=6, **FEATURES)
    engine = llm.llm_engine
    try:
        assert engine.executor.world_size == 2 * tp
        assert greedy(llm, max_tokens=FEATURE_TOKENS) == expected
        assert greedy(llm, max_tokens=FEATURE_TOKENS) == expected  # prefix-cache hits
        assert engine.stats().num_preemptions > 0
        assert sum(s.block_manager.num_prefix_hit_blocks for s in engine.schedulers) > 0
    finally:
        engine.shutdown()


def test_uneven_split_matches_pp1(checkpoint_factory, tp1_tokens) -> None:
    """pp_layer_partition reaches the worker processes."""
    expected = tp1_tokens("llama", {"num_hidden_layers": 3})
    llm = LLM(checkpoint_factory("llama", num_hidden_layers=3), device="cpu", dtype="float32",
              pipeline_parallel_size=2, pp_layer_partition=[1, 2])
    try:
        assert greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()


# --- a stage dying mid-step -----------------------------------------------------------------
def test_killed_stage_ends_every_request_and_health_turns_503(checkpoint_factory) -> None:
    """SIGKILL of the last stage's worker while four streams run (so batches of both virtual
    engines are in flight): every stream ends with an error naming the dead rank, /health and
    new requests answer 503, nothing hangs, and no worker outlives the engine."""
    import asyncio
    import json
    import os
    import signal
    import time

    import httpx

    from pagedllm import AsyncEngineArgs, AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import ServerSettings

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=checkpoint_factory("llama"), device="cpu", dtype="float32",
        pipeline_parallel_size=2, disable_log_requests=True))
    app = build_app(engine, ServerSettings(served_model_names=["tiny"]))
    processes = [w.process for w in engine.engine.executor.workers]
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True,
            "stream": True}

    async def main() -> float:
        engine.start_background_loop()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            streams = [asyncio.create_task(client.post("/v1/completions", json=body))
                       for _ in range(4)]
            while engine.engine.stats().num_running < 4:  # all admitted, generating
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            killed_at = time.monotonic()
            os.kill(processes[1].pid, signal.SIGKILL)
            for response in await asyncio.gather(*streams):
                events = [line[6:] for line in response.text.splitlines()
                          if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]["message"]
                assert "worker rank 1 died" in error and "SIGKILL" in error
                assert len(events) - 2 < 480  # ended early, by the error
            waited = time.monotonic() - killed_at
            failed = await client.post("/v1/completions", json={**body, "stream": False})
            assert failed.status_code == 503
            health = await client.get("/health")
            assert health.status_code == 503
            assert "worker rank 1 died" in health.json()["error"]["message"]
        await engine.shutdown()
        return waited

    assert asyncio.run(main()) < 10.0
    assert all(not p.is_alive() for p in processes)


# --- cuda (NCCL): run where two GPUs are visible -------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_pp2_matches_pp1(arch: str, checkpoint_factory) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    path = checkpoint_factory(arch)
    single = LLM(path, device="cuda", dtype="float32")
    expected = greedy(single)
    single.llm_engine.shutdown()
    del single
    llm = LLM(path, device="cuda", dtype="float32", pipeline_parallel_size=2)
    try:
        assert llm.llm_engine.backend.dist_backend == "nccl"
        assert greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()
