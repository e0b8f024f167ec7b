"""Claims verified, not assumed: ``graphs`` and ``async_output`` are proven by what the worker
did (its ``counters``), and their results equal the plain path's, token for token.

``Worker.counters`` (a Counter on the base class): ``launches`` and ``returned_before_done``
are counted by ``Worker.execute_async`` (the latter when ``PendingOutputs.done()`` was still
False as ``launch_model`` returned); a graph-capturing worker adds ``graph_captures`` when it
captures and ``graph_replays`` each time a step runs from a graph.

The suite's checkpoint is tiny: on a fast GPU its steps finish while the host is still returning
from the launch, so "returned before the device finished" would be luck. The async check first
queues ~20 ms of matrix products on the device before every launch (``_busy_device``): a
``launch_model`` that does not wait for the device returns while that work (and the step
behind it) still runs; one that synchronizes waits for it and is caught.
"""
from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.e2e import engine_greedy, first_mismatch
from pagedllm.testing.test_e2e import started_llm

AREA = "claims (graphs, async, TP)"
NEEDS_ENGINE = True  # runs an LLM on the device (skipped for kernel-only backends)
CAPABILITY_OF = {"test_tensor_parallel_where_this_machine_can": "tensor parallel 2"}


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(module, "synchronize"):
        module.synchronize()


def _busy_device(worker: Any, seconds: float = 0.02) -> None:
    """Queue about ``seconds`` of matrix products on the worker's device (its current stream)
    before each of its launches. Wraps the instance's ``launch_model``; the step itself is
    unchanged."""
    device = worker.device
    x = torch.randn(1024, 1024, device=device) / 32  # products stay finite
    out = torch.empty_like(x)
    torch.mm(x, x, out=out)
    _synchronize(device)
    start = time.perf_counter()
    torch.mm(x, x, out=out)
    _synchronize(device)
    reps = max(1, min(2000, math.ceil(seconds / max(time.perf_counter() - start, 1e-6))))
    launch = worker.launch_model

    def busy_launch(batch: Any) -> Any:
        for _ in range(reps):
            torch.mm(x, x, out=out)
        return launch(batch)

    worker.launch_model = busy_launch


def _worker(llm: Any) -> Any:
    worker = getattr(llm.llm_engine.executor, "worker", None)
    if worker is None:
        pytest.fail("the claim checks need the in-process executor (tensor_parallel_size=1), "
                    "whose worker exposes counters")
    return worker


@pytest.mark.capability("dtype:float32", "graphs")
def test_graphs_are_captured_and_replayed(conformance_checkpoint: str,
                                          conformance_device_name: str,
                                          conformance_caps: Capabilities,
                                          conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    # one engine at a time: each sizes its KV cache from the device memory the last gave back
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                     enforce_eager=False) as llm:
        assert not llm.llm_engine.config.enforce_eager, (
            "graphs=True is declared but check_and_update_config turned enforce_eager back on")
        replay = engine_greedy(llm, ps)
        counters = _worker(llm).counters
    assert counters["graph_captures"] > 0, (
        f"graphs=True is declared but no graph was captured (worker counters: {dict(counters)})")
    assert counters["graph_replays"] > 0, (
        f"graphs=True is declared but no step ran from a graph (worker counters: "
        f"{dict(counters)})")
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                     enforce_eager=True) as llm:
        eager = engine_greedy(llm, ps)
    assert replay == eager, f"graph replay differs from eager: {first_mismatch(replay, eager)}"
    assert replay == expected, f"graph replay vs transformers: {first_mismatch(replay, expected)}"


@pytest.mark.capability("dtype:float32", "async_output")
def test_async_output_returns_before_the_device_finishes(
        conformance_checkpoint: str, conformance_device_name: str,
        conformance_caps: Capabilities, conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps) as llm:
        _busy_device(_worker(llm))
        got = engine_greedy(llm, ps)
        counters = _worker(llm).counters
    assert counters["launches"] > 0, (
        f"async_output=True is declared but the engine never launched a step asynchronously "
        f"(worker counters: {dict(counters)})")
    assert counters["returned_before_done"] > 0, (
        f"async_output=True is declared but launch_model returned after the device finished in "
        f"all {counters['launches']} launches (PendingOutputs.done() was always True)")
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                     disable_async_output_proc=True) as llm:
        sync = engine_greedy(llm, ps)
    assert got == sync, f"async output differs from the synchronous path: {first_mismatch(got, sync)}"
    assert got == expected, f"async output vs transformers: {first_mismatch(got, expected)}"


@pytest.mark.capability("dtype:float32")
def test_tensor_parallel_where_this_machine_can(conformance_checkpoint: str,
                                                conformance_device_name: str,
                                                conformance_caps: Capabilities,
                                                conformance_backend: Any,
                                                conformance_hf_reference: tuple[list, list]
                                                ) -> None:
    """``max_tensor_parallel_size`` (None or >= 2): two ranks on this machine give
    transformers' greedy tokens. Host-memory backends (torch device cpu) run ranks as
    processes; others need two devices here."""
    limit = conformance_caps.max_tensor_parallel_size
    if limit is not None and limit < 2:
        pytest.skip(f"max_tensor_parallel_size={limit}: tensor parallelism not declared")
    if conformance_backend.torch_device != "cpu" and conformance_backend.device_count() < 2:
        pytest.skip("tensor parallelism needs two devices; this machine has "
                    f"{conformance_backend.device_count()}")
    ps, expected = conformance_hf_reference
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                     tensor_parallel_size=2) as llm:
        got = engine_greedy(llm, ps)
    assert got == expected, f"tensor_parallel_size=2: {first_mismatch(got, expected)}"
