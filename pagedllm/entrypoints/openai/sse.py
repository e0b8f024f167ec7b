"""A streaming response that always runs a cleanup (abort the requests), however it ends."""
from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    """``text/event-stream``; ``on_close`` runs after the stream ends, fails or the client leaves.

    Starlette does not close a body iterator it never started (a client gone before the first
    byte), so the requests are aborted here rather than in the generator's ``finally``.
    """

    def __init__(self, content: AsyncIterable[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
