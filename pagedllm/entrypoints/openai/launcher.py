"""Runs the app under uvicorn with a graceful SIGTERM: drain, then exit 0.

On SIGTERM (or Ctrl-C) new requests get 503 while in-flight ones have ``shutdown_timeout`` seconds
to finish; what is still running then is cancelled (its engine requests are aborted) and the
process exits with status 0. A second signal stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pagedllm.entrypoints.openai.middleware import ServerState

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0  # after the drain: how long cancelled handlers get to unwind


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # unlike uvicorn, the signal is not re-raised after shutdown: the exit status stays 0
        if self.state.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        logger.info("received %s: refusing new requests, draining %d in flight (up to %.0f s)",
                    signal.Signals(sig).name, self.state.in_flight, self.shutdown_timeout)
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
                           "cancelling them", self.state.in_flight, self.shutdown_timeout)
        self.should_exit = True


async def serve_http(app: FastAPI, state: ServerState, host: str, port: int,
                     shutdown_timeout: float, log_level: str = "info",
                     access_log: bool = True) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=CANCEL_GRACE_S, timeout_keep_alive=5)
    server = GracefulServer(config, state, shutdown_timeout)
    await server.serve()
