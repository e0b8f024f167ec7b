"""In-process app (no server): once a step raises, streams end with an error event, and /health
and new requests answer 503."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedllm import AsyncEngineArgs, AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerSettings


def test_dead_engine_is_unhealthy(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=tiny_model, device="cpu", dtype="float32", num_gpu_blocks_override=32,
        disable_log_requests=True))
    app = build_app(engine, ServerSettings(served_model_names=["tiny"]))
    real_execute = engine.engine.executor.execute
    calls = {"n": 0}

    def fails_on_fourth_step(batch):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] >= 4:
            raise RuntimeError("injected failure")
        return real_execute(batch)

    monkeypatch.setattr(engine.engine.executor, "execute", fails_on_fourth_step)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "ignore_eos": True}

    async def main() -> None:
        engine.start_background_loop()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "injected failure" in json.loads(events[-2])["error"]["message"]
            assert len(events) == 3 + 2  # three tokens, the error, [DONE]
            failed = await client.post("/v1/completions", json=body)
            assert failed.status_code == 503
            assert failed.json()["error"]["code"] == "engine_dead"
            health = await client.get("/health")
            assert health.status_code == 503
            assert "injected failure" in health.json()["error"]["message"]
        await engine.shutdown()

    asyncio.run(main())
