"""Runs the app under uvicorn with a graceful shutdown on SIGTERM or SIGINT (Ctrl-C).

The first signal drains: new requests get 503 while in-flight ones have ``shutdown_timeout``
seconds to finish. At that deadline every request still running ends: a stream with a final SSE
error event (``{"error": {..., "code": "shutdown"}}``) and ``data: [DONE]``, a non-streamed one
with a 503 JSON body; then the server stops, the engine process with it, and the process exits 0,
within the timeout plus a few seconds. A second signal stops at once: the engine process is killed,
and the process exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from http import HTTPStatus
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.middleware import ServerState
from pagedllm.logger import uvicorn_log_config

logger = logging.getLogger(__name__)

END_GRACE_S = 2.0  # after the deadline: how long ended handlers get to send their last bytes


def shutdown_error() -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                       "the server shut down before this request finished (--shutdown-timeout); "
                       "retry it elsewhere", code="shutdown")


class _DropCancelledAtShutdown(logging.Filter):
    """uvicorn logs a handler it cancels at shutdown as "Exception in ASGI application" with a
    CancelledError traceback; once the server is stopping that cancellation is expected."""

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (self.state.draining and isinstance(exc, asyncio.CancelledError))


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float,
                 end_requests: Callable[[BaseException], None],
                 kill_engine: Callable[[], None]) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.end_requests = end_requests  # ends every running request's stream with the error
        self.kill_engine = kill_engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # unlike uvicorn's, the signal is not re-raised after a drain: the exit status stays 0
        name = signal.Signals(sig).name
        if self.state.draining or self._loop is None:
            logger.warning("received %s %s: stopping now (engine process included)", name,
                           "again" if self.state.draining else "before serving")
            self.kill_engine()
            logging.shutdown()  # flushes the handlers; nothing else runs after this
            os._exit(128 + sig)
        self.state.draining = True
        logger.info("received %s: refusing new requests, draining %d in flight (up to %.0f s; "
                    "%s again stops at once)", name, self.state.in_flight, self.shutdown_timeout,
                    name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._loop is not None
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.state.wait_idle(), timeout=self.shutdown_timeout)
            logger.info("all requests finished; shutting down")
        except asyncio.TimeoutError:
            logger.warning("%d request(s) still running after --shutdown-timeout=%.0f s; "
                           "ending them with a 'shutdown' error", self.state.in_flight,
                           self.shutdown_timeout)
            self.end_requests(shutdown_error())
            try:
                await asyncio.wait_for(self.state.wait_idle(), timeout=END_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning("%d request(s) did not end; closing their connections",
                               self.state.in_flight)
        self.should_exit = True


async def serve_http(app: FastAPI, state: ServerState, host: str, port: int,
                     shutdown_timeout: float, end_requests: Callable[[BaseException], None],
                     kill_engine: Callable[[], None], log_level: str = "info",
                     access_log: bool = True) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=END_GRACE_S, timeout_keep_alive=5,
                            log_config=uvicorn_log_config())
    server = GracefulServer(config, state, shutdown_timeout, end_requests, kill_engine)
    logging.getLogger("uvicorn.error").addFilter(_DropCancelledAtShutdown(state))
    await server.serve()
