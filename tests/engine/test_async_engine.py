"""AsyncLLMEngine without a server: streaming, aborts free blocks, a failing step kills the engine."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from pagedllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from pagedllm.engine.async_engine import EngineDeadError

NUM_BLOCKS = 64


def make_engine(model: str) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, device="cpu", dtype="float32", num_gpu_blocks_override=NUM_BLOCKS,
        disable_log_requests=True))


@pytest.fixture(scope="module")
def engine(llama_path: str) -> Iterator[AsyncLLMEngine]:
    engine = make_engine(llama_path)
    yield engine
    engine.engine.shutdown()


def params(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kwargs)


async def all_blocks_free(engine: AsyncLLMEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_free_blocks + s.num_cached_blocks == s.num_blocks and not s.num_running:
            return True
        await asyncio.sleep(0.01)
    return False


def test_generate_streams_cumulative_outputs(engine: AsyncLLMEngine) -> None:
    async def main() -> list:
        return [out async for out in engine.generate("hello", params(6), "r1")]

    outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in outs] == [False] * 5 + [True]
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].outputs[0].finish_reason == "length"
    assert engine.is_running is False  # asyncio.run's loop is gone


def test_generate_streams_delta_outputs(engine: AsyncLLMEngine) -> None:
    from pagedllm import RequestOutputKind

    async def main(kind: RequestOutputKind) -> list:
        return [out async for out in engine.generate("hello", params(6, output_kind=kind),
                                                     kind.name)]

    cum, delta = asyncio.run(main(RequestOutputKind.CUMULATIVE)), asyncio.run(
        main(RequestOutputKind.DELTA))
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 6
    assert sum((o.outputs[0].token_ids for o in delta), []) == cum[-1].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == cum[-1].outputs[0].text
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "length"


def test_concurrent_requests_and_blocks_freed(engine: AsyncLLMEngine) -> None:
    async def one(i: int) -> int:
        last = None
        async for out in engine.generate([10 + i, 20, 30], params(5 + i), f"c{i}"):
            last = out
        return len(last.outputs[0].token_ids)

    async def main() -> list[int]:
        lengths = await asyncio.gather(*(one(i) for i in range(8)))
        assert await all_blocks_free(engine)
        return lengths

    assert asyncio.run(main()) == [5 + i for i in range(8)]


def test_abort_finishes_stream_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        outs = []
        async for out in engine.generate("abort me", params(200), "a1"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("a1")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(outs[-1].outputs[0].token_ids) < 200
        assert await all_blocks_free(engine)

    asyncio.run(main())


def test_closing_or_cancelling_the_generator_aborts(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        gen = engine.generate("close me", params(300), "g1")
        await gen.__anext__()
        await gen.aclose()
        assert await all_blocks_free(engine)

        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("cancel me", params(300), "g2"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert engine.get_stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await all_blocks_free(engine)
        # the engine keeps serving
        outs = [o async for o in engine.generate("after", params(2), "g3")]
        assert outs[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())


def test_bad_requests_raise_value_error(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("e1", [], params())
        with pytest.raises(ValueError, match="out of range"):
            await engine.add_request("e2", [100000], params())
        stream = await engine.add_request("e3", "dup", params(50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("e3", "dup", params())
        stream.abort()
        assert await all_blocks_free(engine)

    asyncio.run(main())


def test_step_runs_on_one_thread_and_loop_stays_responsive(engine: AsyncLLMEngine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    executor = engine.engine.executor
    real_execute = executor.execute
    threads: set[int] = set()
    busy = threading.Lock()

    def slow_execute(batch):  # noqa: ANN001, ANN202
        assert busy.acquire(blocking=False), "two steps at once"
        try:
            threads.add(threading.get_ident())
            time.sleep(0.05)
            return real_execute(batch)
        finally:
            busy.release()

    monkeypatch.setattr(executor, "execute", slow_execute)

    async def main() -> int:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        async def run(i: int) -> list:
            return [o async for o in engine.generate(f"p{i}", params(4), f"t{i}")]

        tick_task = asyncio.create_task(ticker())
        await asyncio.gather(*(run(i) for i in range(4)))
        done.set()
        await tick_task
        return ticks

    ticks = asyncio.run(main())
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert ticks >= 20  # ~4 slow steps of 50 ms: the loop ran throughout


def test_exception_in_step_fails_requests_and_kills_engine(llama_path: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(llama_path)
    executor = engine.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def failing_execute(batch):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("device fell off the bus")
        return real_execute(batch)

    monkeypatch.setattr(executor, "execute", failing_execute)

    async def consume(i: int) -> BaseException | None:
        try:
            async for _ in engine.generate(f"x{i}", params(100), f"d{i}"):
                pass
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None

    async def main() -> None:
        errors = await asyncio.gather(*(consume(i) for i in range(3)))
        for err in errors:
            assert isinstance(err, EngineDeadError), err
            assert isinstance(err.__cause__, RuntimeError)
            assert "device fell off the bus" in str(err)
        assert engine.errored and not engine.is_running
        assert isinstance(engine.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("later", params(), "d9"):
                pass

    asyncio.run(main())
    assert "engine step failed" in caplog.text
    engine.engine.shutdown()


def test_shutdown_fails_pending_requests(llama_path: str) -> None:
    engine = make_engine(llama_path)

    async def main() -> None:
        stream = await engine.add_request("s1", "bye", params(500))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("s2", "bye", params())

    asyncio.run(main())
