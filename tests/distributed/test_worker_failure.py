"""A worker killed mid-generation makes the engine fail fast with a clear error, and no worker
process outlives the engine."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.batch import ScheduledBatch
from pagedllm.distributed.errors import WorkerDiedError, WorkerError
from tp_utils import tp_prompts, wait_until

pytestmark = pytest.mark.timeout(300)

FAIL_FAST_S = 10.0


@pytest.mark.parametrize("rank", [1, 0])
def test_killed_worker_fails_the_step_fast(rank: int, checkpoint_factory) -> None:
    llm = LLM(checkpoint_factory("llama"), device="cpu", dtype="float32", tensor_parallel_size=2)
    engine = llm.llm_engine
    executor = engine.executor
    processes = [w.process for w in executor.workers]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(tp_prompts()):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
    executor.check_health()
    killed_at: list[float] = []

    def kill() -> None:  # lands inside or between steps, whichever comes
        time.sleep(0.2)
        killed_at.append(time.monotonic())
        os.kill(processes[rank].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(WorkerDiedError, match=f"worker rank {rank} died: .*killed by SIGKILL"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            engine.step()
    killer.join()
    assert time.monotonic() - killed_at[0] < FAIL_FAST_S
    with pytest.raises(WorkerError, match="failed earlier"):  # stays failed, never hangs
        executor.execute(ScheduledBatch())
    with pytest.raises(WorkerDiedError):
        executor.check_health()
    assert wait_until(lambda: not any(p.is_alive() for p in processes), timeout=10)
    engine.shutdown()
    assert not set(multiprocessing.active_children()) & set(processes)
