"""The proxy of `pagedllm proxy` (pagedllm/entrypoints/proxy.py): for each completion or chat
request, the prefill instance first (one token, not streamed), then the decode instance, whose
answer is returned; a failed prefill is logged and counted and the decode instance computes the
prompt itself."""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("pagedllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


class Proxy:
    """The routing and its counters; ``app()`` is the FastAPI application."""

    def __init__(self, prefill: list[str], decode: list[str],
                 prefill_timeout: float = 300.0) -> None:
        for name, urls in (("--prefill", prefill), ("--decode", decode)):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name} {url!r} is not an http(s) URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._prefill_next = itertools.cycle(self.prefill_urls)
        self._decode_next = itertools.cycle(self.decode_urls)
        self.prefill_timeout = prefill_timeout
        self.counters = {"requests": 0, "prefill_failures": 0, "prefill_seconds": 0.0}
        self._client: Any = None

    @staticmethod
    def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
        """The request a prefill instance runs: the same prompt and parameters, one token,
        one choice, not streamed."""
        out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        out.update(max_tokens=1, n=1, stream=False)
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        return out

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        url = next(self._prefill_next) + path
        start = time.perf_counter()
        try:
            resp = await self._client.post(url, json=self.prefill_body(body), headers=headers,
                                           timeout=self.prefill_timeout)
            if resp.status_code >= 400:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        except Exception as exc:  # any failure: the decode instance computes the prompt
            self.counters["prefill_failures"] += 1
            logger.warning("prefill at %s failed (%s: %s); the decode instance computes the "
                           "prompt itself", url, type(exc).__name__, exc)
        finally:
            self.counters["prefill_seconds"] += time.perf_counter() - start

    def app(self) -> FastAPI:
        proxy = self

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            proxy._client = httpx.AsyncClient(timeout=None)
            yield
            await proxy._client.aclose()

        app = FastAPI(title="pagedllm proxy", lifespan=lifespan)

        def forward_headers(request: Request) -> dict[str, str]:
            return {k: v for k, v in request.headers.items()
                    if k.lower() in ("authorization", "x-request-id")}

        async def route(request: Request) -> Response:
            body = await request.json()
            headers = forward_headers(request)
            proxy.counters["requests"] += 1
            await proxy.prefill(request.url.path, body, headers)
            url = next(proxy._decode_next) + request.url.path
            if body.get("stream"):
                req = proxy._client.build_request("POST", url, json=body, headers=headers)
                resp = await proxy._client.send(req, stream=True)

                async def chunks() -> Any:
                    try:
                        async for chunk in resp.aiter_raw():
                            yield chunk
                    finally:
                        await resp.aclose()

                return StreamingResponse(chunks(), status_code=resp.status_code,
                                         media_type=resp.headers.get("content-type"))
            resp = await proxy._client.post(url, json=body, headers=headers)
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        for path in ROUTES:
            app.add_api_route(path, route, methods=["POST"])

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            resp = await proxy._client.get(proxy.decode_urls[0] + "/v1/models",
                                           headers=forward_headers(request))
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        @app.get("/health")
        async def health() -> Response:
            try:
                resp = await proxy._client.get(proxy.decode_urls[0] + "/health", timeout=5)
                ok = resp.status_code == 200
            except Exception:
                ok = False
            return JSONResponse({"decode": ok}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            c = proxy.counters
            text = (f"# TYPE pagedllm:proxy_requests_total counter\n"
                    f"pagedllm:proxy_requests_total {c['requests']}\n"
                    f"# TYPE pagedllm:proxy_prefill_failures_total counter\n"
                    f"pagedllm:proxy_prefill_failures_total {c['prefill_failures']}\n"
                    f"# TYPE pagedllm:proxy_prefill_seconds_total counter\n"
                    f"pagedllm:proxy_prefill_seconds_total {c['prefill_seconds']:.6f}\n")
            return Response(text, media_type="text/plain; version=0.0.4")

        return app
