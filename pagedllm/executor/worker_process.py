"""A worker in a fresh interpreter, its environment set before torch loads: how an engine on the
host CPU gets libgomp's spin policy when torch was imported before pagedllm.

libgomp reads ``GOMP_SPINCOUNT`` once, when it is loaded (``import torch``): a pool thread that
reaches the barrier at the end of an op spins that many iterations (300,000 by default) before it
sleeps. On cores shared with other processes the spinning threads take the time slices the
working ones need (benchmarks/busy_machine.py). ``import pagedllm`` and the ``pagedllm`` command
set ``GOMP_SPINCOUNT=10000`` where torch is not loaded yet and the user chose no policy
(entrypoints/omp_env.py). A script that imported torch first has libgomp's default for good;
then ``spin_policy_missing()`` is True and the engine runs its worker here, in a process started
with ``python -m pagedllm.executor.worker_process`` and the variable set, as vLLM V1 runs its
engine core in a process of its own. A fresh interpreter, not multiprocessing's spawn: spawn
imports the user's main module again, so a script without ``if __name__ == "__main__":`` would
build a second engine in the child.

The parent talks to the child over a socket pair with multiprocessing's Connection; the child
serves executor/multiproc.py's worker loop, so MultiprocExecutor drives it like a spawned rank
(``launch`` is its launcher). Importing this module imports no torch.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.contract.backend import Backend
    from pagedllm.distributed.worker_wrapper import WorkerSpec

logger = logging.getLogger(__name__)

SPINCOUNT_ENV = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_SPINCOUNT = "10000"  # spin ~10k iterations, then sleep (libgomp's default: 300,000)
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # the folder that holds pagedllm/


def spin_policy_missing() -> bool:
    """True when this process's libgomp spins with its default: neither pagedllm (before torch
    loaded) nor the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY."""
    return SPINCOUNT_ENV not in os.environ and WAIT_POLICY_ENV not in os.environ


def run_apart(backend: Backend) -> bool:
    """Whether a single worker of ``backend`` should run in a process of its own: its model runs
    on the host CPU's OpenMP threads and this process's libgomp spins with its default. Logs
    why when it does."""
    if backend.torch_device != "cpu" or not spin_policy_missing():
        return False
    logger.info("the %s worker runs in a process of its own with %s=%s: torch was imported "
                "before pagedllm, so this process's OpenMP threads spin with libgomp's default "
                "(import pagedllm first, or set %s or %s, to keep the worker in this process)",
                backend.name, SPINCOUNT_ENV, DEFAULT_SPINCOUNT, SPINCOUNT_ENV, WAIT_POLICY_ENV)
    return True


def worker_env() -> dict[str, str]:
    """This process's environment plus the spin default, with the folder this process imported
    pagedllm from last on PYTHONPATH (a checkout on sys.path only is found; an installed
    package or the standard library are never shadowed)."""
    env = dict(os.environ)
    env.setdefault(SPINCOUNT_ENV, DEFAULT_SPINCOUNT)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, _PACKAGE_PARENT])
    return env


class WorkerProcess:
    """The child as multiprocessing.Process shows one to MultiprocExecutor: pid, a sentinel that
    turns readable when it exits, is_alive / join / terminate / kill, exitcode (minus the signal
    number when a signal ended it)."""

    def __init__(self, popen: subprocess.Popen, sentinel: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = sentinel  # read end of a pipe whose write end only the child holds
        self._close = weakref.finalize(self, os.close, sentinel)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def launch(rank: int, spec: WorkerSpec, name: str) -> tuple[WorkerProcess, Connection]:
    """Start ``python -m pagedllm.executor.worker_process`` for ``spec`` (rank ``rank``, shown
    as ``name`` in the log) with worker_env(); the process and the parent's end of its
    connection. MultiprocExecutor's launcher."""
    ours, theirs = socket.socketpair()
    sentinel, held = os.pipe()  # `held` stays open in the child until it exits
    try:
        argv = [sys.executable, "-m", "pagedllm.executor.worker_process", str(theirs.fileno()),
                str(held)]
        popen = subprocess.Popen(argv, pass_fds=(theirs.fileno(), held), env=worker_env(),
                                 stdin=subprocess.DEVNULL)
    except BaseException:
        os.close(sentinel)
        raise
    finally:
        theirs.close()
        os.close(held)
    conn = Connection(ours.detach())
    conn.send(spec)  # pickled like multiprocessing's arguments
    logger.debug("started worker %s (rank %d) in a fresh interpreter, pid %d", name, rank,
                 popen.pid)
    return WorkerProcess(popen, sentinel), conn


def _main(argv: list[str]) -> None:
    """The child: read the WorkerSpec, then serve the executor's calls until told to stop."""
    conn = Connection(int(argv[0]))  # argv[1]: the sentinel's write end, held open until exit
    spec = conn.recv()
    from pagedllm.executor.multiproc import _worker_main

    _worker_main(conn, spec)


if __name__ == "__main__":
    _main(sys.argv[1:])
