"""64 streaming clients, 8 of which hang up mid-stream; disconnects abort and free every block."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai

MAX_TOKENS = 16
NUM_CLIENTS = 64
NUM_QUITTERS = 8


def wait_for_idle(server, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["pagedllm:num_free_blocks"] == m["pagedllm:num_gpu_blocks"]
                and m["pagedllm:num_requests_running"] == 0
                and m["pagedllm:num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def run_client(client: openai.AsyncOpenAI, i: int, quit_after: int | None
                     ) -> tuple[int, str | None, int | None]:
    """(content chunks seen, last finish_reason, usage.completion_tokens)."""
    chunks, finish, used = 0, None, None
    max_tokens = 400 if quit_after else MAX_TOKENS
    if i % 2:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"client {i}"}],
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
    else:
        stream = await client.completions.create(
            model="tiny", prompt=f"client {i}", max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if i % 2 and choice.delta.role == "assistant":
            continue  # the role chunk carries no token
        chunks += 1
        finish = choice.finish_reason or finish
        if quit_after and chunks >= quit_after:
            await stream.close()
            break
    return chunks, finish, used


def test_many_streams_with_disconnects(server) -> None:
    before = server.metrics()
    quitters = set(range(3, NUM_CLIENTS, NUM_CLIENTS // NUM_QUITTERS))
    assert len(quitters) == NUM_QUITTERS

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(run_client(client, i, 3 if i in quitters else None)
                                          for i in range(NUM_CLIENTS)))

    results = asyncio.run(main())
    for i, (chunks, finish, used) in enumerate(results):
        if i in quitters:
            assert chunks == 3
            continue
        assert (chunks, finish, used) == (MAX_TOKENS, "length", MAX_TOKENS), i
    after = wait_for_idle(server)
    assert after["pagedllm:num_free_blocks"] == after["pagedllm:num_gpu_blocks"]
    assert after["pagedllm:num_requests_running"] == 0
    aborted = after.get("pagedllm:request_success_total{abort}", 0) - before.get(
        "pagedllm:request_success_total{abort}", 0)
    assert aborted == NUM_QUITTERS
    # every aborted request stopped long before its 400 tokens
    generated = after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"]
    assert generated < (NUM_CLIENTS - NUM_QUITTERS) * MAX_TOKENS + NUM_QUITTERS * 200


def test_non_streaming_disconnect_aborts(server) -> None:
    """The client hangs up once the server reports the request running (a fixed client timeout
    raced the generation: a fast CPU finished the 480 tokens in under 0.3 s)."""
    before = server.metrics()
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 480, "ignore_eos": True}

    async def hang_up_while_running() -> bool:
        async with httpx.AsyncClient(timeout=60) as client:
            post = asyncio.create_task(client.post(f"{server.base_url}/v1/completions", json=body))
            while not post.done():
                running = (await asyncio.to_thread(server.metrics))["pagedllm:num_requests_running"]
                if running >= 1:
                    post.cancel()  # closes the connection mid-request
                    await asyncio.gather(post, return_exceptions=True)
                    return True
                await asyncio.sleep(0.002)
            return False

    assert asyncio.run(hang_up_while_running()), \
        "the request finished before the client saw it running; make it longer"
    after = wait_for_idle(server)
    assert after["pagedllm:num_free_blocks"] == after["pagedllm:num_gpu_blocks"]
    aborted = after.get("pagedllm:request_success_total{abort}", 0) - before.get(
        "pagedllm:request_success_total{abort}", 0)
    assert aborted == 1
