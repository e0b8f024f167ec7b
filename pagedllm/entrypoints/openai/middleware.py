"""Pure ASGI middleware: refuse new work while draining, API-key auth, request body size limit.

Order (outermost first): DrainGuard -> ApiKeyAuth -> BodySizeLimit -> the app.
"""
from __future__ import annotations

import asyncio
import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError

UNAUTHENTICATED_PATHS = frozenset({"/health", "/ping"})


async def send_error(send: Send, error: OpenAIError, headers: list[tuple[bytes, bytes]] = ()
                     ) -> None:
    body = error.json_bytes()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class ServerState:
    """In-flight HTTP requests and whether the server is draining for shutdown."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class DrainGuard:
    """Counts in-flight requests; once draining, new requests get 503."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await send_error(send, OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                                               "the server is shutting down; retry elsewhere"),
                             [(b"connection", b"close")])
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()


class ApiKeyAuth:
    """``Authorization: Bearer KEY`` on every path but /health and /ping, decided from
    ``scope["path"]``; the scheme is case-insensitive (RFC 9110), the key is not."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNAUTHENTICATED_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        if not hmac.compare_digest(given, self.expected):
            await send_error(send, OpenAIError(
                HTTPStatus.UNAUTHORIZED, "missing or invalid API key: send the header "
                "'Authorization: Bearer <key>' with the key the server was started with",
                code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 for bodies over ``max_bytes``: from Content-Length, or by reading a chunked body first."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"request body is larger than the limit of {self.max_bytes} bytes "
                           "(--max-request-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
                break
        if length is not None:
            if length > self.max_bytes:
                await send_error(send, self._too_large(), [(b"connection", b"close")])
                return
            await self.app(scope, receive, send)
            return
        # no Content-Length (chunked, or no body): read it here, then replay it to the app
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, self._too_large(), [(b"connection", b"close")])
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def replay_receive() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)
