"""Tensor and pipeline parallelism on one host: one spawned worker process per rank.

The driver (the engine's process) holds no model and no process group; it pickles each call
once, sends it to every rank over a pipe and waits for all replies. Waiting also watches every
worker's process sentinel, so a worker that dies (SIGKILL, OOM, segfault) turns into a
WorkerDiedError within moments instead of a hang; after any failure the executor refuses
further calls and its workers are terminated. Workers are stopped on ``shutdown()``, when the
executor is garbage-collected, and at interpreter exit.

``submit`` sends a step without waiting for its replies, so with pipeline stages several steps
are in flight (each rank serves its pipe in order; stage i works on one step while stage i+1
works on the one before); replies are read back in submission order.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.distributed.errors import RemoteFailure, WorkerDiedError, WorkerError, exit_reason
from pagedllm.distributed.utils import (forwarded_env, get_open_port, loopback_interface,
                                        worker_num_threads)
from pagedllm.distributed.worker_wrapper import WorkerSpec, WorkerWrapper
from pagedllm.executor.base import MultiWorkerExecutor
from pagedllm.worker.pending import PendingOutputs

logger = logging.getLogger(__name__)

_SHUTDOWN = pickle.dumps(("shutdown", ()))
GRACEFUL_EXIT_S = 5.0  # how long workers get to leave after "shutdown" before SIGTERM
DEATH_GRACE_S = 1.0  # after a worker error, how long to look for a dead peer (the likelier cause)


def _worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A worker process: start the rank, then serve (method, args) calls until told to stop or
    until the driver goes away (EOF on the pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    from pagedllm.logger import configure_logging

    configure_logging()  # a spawned process starts without handlers
    wrapper = WorkerWrapper()
    try:
        wrapper.init_worker(spec)
    except BaseException as exc:
        conn.send(("error", RemoteFailure.capture(exc)))
        raise SystemExit(1) from None
    conn.send(("ok", None))
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone
        if method == "shutdown":
            break
        try:
            reply = ("ok", getattr(wrapper, method)(*args))
        except Exception as exc:
            reply = ("error", RemoteFailure.capture(exc))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    wrapper.close()
    # leave without the interpreter's teardown: garbage-collector passes over torch's objects
    # take seconds on a busy machine, and the driver waits for this exit
    logging.shutdown()
    os._exit(0)


# (rank, spec, name) -> (its process, the driver's end of its pipe): how a rank is started
Launcher = Callable[[int, WorkerSpec, str], tuple[Any, Connection]]


def spawn_worker(rank: int, spec: WorkerSpec, name: str) -> tuple[Any, Connection]:
    """The default launcher: a multiprocessing spawn child running _worker_main (fork is unsafe
    once torch/CUDA threads exist)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True, name=name)
    proc.start()
    child.close()
    return proc, parent


class _Submitted(PendingOutputs):
    """A submitted step; ``result()`` reads the replies of it and of every step before it."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__([])
        self._executor = executor
        self.done = False

    def set(self, outputs: list[SeqOutput]) -> None:
        self._outputs, self.done = outputs, True

    def result(self) -> list[SeqOutput]:
        self._executor._read_through(self)
        return self._outputs


@dataclass
class _WorkerHandle:
    rank: int
    process: Any  # multiprocessing SpawnProcess
    conn: Connection


def _stop_workers(workers: list[_WorkerHandle], graceful: bool) -> None:
    """Ask, then SIGTERM, then SIGKILL; never leaves a process behind. Safe to call twice."""
    if graceful:
        for w in workers:
            try:
                w.conn.send_bytes(_SHUTDOWN)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + GRACEFUL_EXIT_S
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
    for sig_name, stop in (("SIGTERM", "terminate"), ("SIGKILL", "kill")):
        alive = [w for w in workers if w.process.is_alive()]
        if not alive:
            break
        for w in alive:
            logger.debug("sending %s to worker rank %d (pid %d)", sig_name, w.rank, w.process.pid)
            getattr(w.process, stop)()
        for w in alive:
            w.process.join(2.0)
    for w in workers:
        w.conn.close()


class MultiprocExecutor(MultiWorkerExecutor):
    def __init__(self, config: EngineConfig, backend: Backend,
                 launcher: Launcher = spawn_worker) -> None:
        super().__init__(config, backend)
        n = config.parallel.world_size
        self.world_size = n
        self._error: BaseException | None = None
        self._submitted: deque[_Submitted] = deque()  # sent, replies not yet read (in order)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        env = forwarded_env()
        if backend.dist_backend == "gloo" and loopback_interface():
            env.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # one host: loopback
        threads = worker_num_threads(n)
        self.workers: list[_WorkerHandle] = []
        for rank in range(n):
            spec = WorkerSpec(config, backend, rank, n, init_method, threads, env)
            pp_rank, tp_rank = divmod(rank, config.parallel.tensor_parallel_size)
            proc, parent = launcher(rank, spec, f"pagedllm-pp{pp_rank}-tp{tp_rank}")
            self.workers.append(_WorkerHandle(rank, proc, parent))
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, True)
        try:
            self._gather("init_worker")
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d worker processes (tensor_parallel_size=%d, pipeline_parallel_size"
                    "=%d; %s, %d threads each)", n, config.parallel.tensor_parallel_size,
                    config.parallel.pipeline_parallel_size, backend.dist_backend, threads)

    # --- the Executor interface ----------------------------------------------------------

    def check_health(self) -> None:
        """Raise if a worker is gone; only looks at the processes (safe during a step)."""
        if self._error is not None:
            raise self._error
        for w in self.workers:
            if not w.process.is_alive():
                raise WorkerDiedError(f"worker rank {w.rank} died: pid {w.process.pid}, "
                                      f"{exit_reason(w.process.exitcode)}")

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            _stop_workers(self.workers, graceful=self._error is None)

    def submit(self, batch: ScheduledBatch) -> PendingOutputs:
        self._send("execute_step", self._pack(batch))
        future = _Submitted(self)
        self._submitted.append(future)
        return future

    def _read_through(self, future: _Submitted) -> None:
        """Read the replies of every step submitted up to and including ``future``."""
        while not future.done:
            if self._error is not None:
                raise WorkerError(f"the workers failed earlier ({self._error}); the engine must "
                                  "be restarted") from self._error
            head = self._submitted.popleft()
            head.set(self._gather("execute_step")[self.output_rank] or [])

    # --- calls ---------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method(*args)`` on every rank; the results in rank order."""
        if self._submitted:
            self._read_through(self._submitted[-1])  # replies arrive in order: older first
        self._send(method, *args)
        return self._gather(method)

    def _send(self, method: str, *args: Any) -> None:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers failed earlier ({self._error}); "
                              "the engine must be restarted") from self._error
        if not self._finalizer.alive:
            raise RuntimeError("the executor was shut down")
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.workers:
            try:
                w.conn.send_bytes(payload)
            except OSError:
                self._fail(self._died(w, method) if not w.process.is_alive()
                           else WorkerDiedError(f"worker rank {w.rank} stopped reading its pipe"))

    def _gather(self, method: str) -> list[Any]:
        """One reply per rank, watching every process so that a death ends the wait at once."""
        results: list[Any] = [None] * self.world_size
        pending = {w.conn: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        while pending:
            ready = wait([*pending, *sentinels])
            for obj in ready:
                if obj in sentinels:
                    self._fail(self._died(sentinels[obj], method))
            for obj in ready:
                w = pending.pop(obj)  # type: ignore[arg-type]
                try:
                    status, value = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(DEATH_GRACE_S)
                    self._fail(self._died(w, method))
                if status == "error":
                    self._fail(self._dead_peer(method, w) or value.to_exception(w.rank, method))
                results[w.rank] = value
        return results

    def _died(self, w: _WorkerHandle, method: str) -> BaseException:
        """The error for a dead worker: the exception it reported before exiting, if any
        (e.g. a bad config while loading), else a WorkerDiedError with its exit status."""
        w.process.join(0.1)
        try:
            if w.conn.poll():
                status, value = w.conn.recv()
                if status == "error":
                    return value.to_exception(w.rank, method)
        except (EOFError, OSError):
            pass
        hint = ("check the worker's log and restart the engine" if method != "init_worker" else
                "check its log above; if the engine is created at the top level of a script, "
                "put that code under `if __name__ == '__main__':` (workers are spawned "
                "processes, which import the main module again)")
        return WorkerDiedError(f"worker rank {w.rank} died: pid {w.process.pid}, "
                               f"{exit_reason(w.process.exitcode)} during {method}; {hint}")

    def _dead_peer(self, method: str, reporter: _WorkerHandle) -> BaseException | None:
        """After one rank reports an error, a peer that died is the likelier cause."""
        peers = [w for w in self.workers if w is not reporter]
        wait([w.process.sentinel for w in peers], timeout=DEATH_GRACE_S)
        for w in peers:
            if not w.process.is_alive():
                return self._died(w, method)
        return None

    def _fail(self, error: BaseException) -> None:
        """Record the failure, stop the workers (they may be stuck in a collective), raise."""
        self._error = error
        self.shutdown()
        raise error
