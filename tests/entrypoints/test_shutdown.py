"""SIGTERM: in-flight requests finish, new ones get 503, the process exits 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx

MAX_TOKENS = 150


def test_sigterm_drains_then_exits_zero(start_server) -> None:
    server = start_server("--shutdown-timeout", "60", "--served-model-name", "tiny")
    first_chunk = threading.Event()
    result: dict = {}

    def stream() -> None:
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        tokens = 0
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    result["done"] = line == "data: [DONE]" or result.get("done", False)
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    tokens += 1
                    first_chunk.set()
                    result["finish"] = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    result["usage"] = chunk["usage"]["completion_tokens"]
        result["tokens"] = tokens
        first_chunk.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert first_chunk.wait(60) and result["status"] == 200, result
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and refused is None:
        try:
            r = httpx.post(f"{server.base_url}/v1/completions",
                           json={"model": "tiny", "prompt": "late", "max_tokens": 2}, timeout=10)
        except httpx.TransportError:
            break  # the listener is closed: the drain already ended
        if r.status_code == 503:
            refused = r
        time.sleep(0.02)
    assert refused is not None, "a new request during the drain was not refused with 503"
    assert refused.json()["error"]["code"] == "service_unavailable"
    worker.join(60)
    assert result == {"status": 200, "tokens": MAX_TOKENS, "finish": "length",
                      "usage": MAX_TOKENS, "done": True}
    assert server.proc.wait(30) == 0, server.logs()
    assert "draining" in server.logs()
