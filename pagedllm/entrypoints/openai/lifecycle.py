"""How the server's processes end: no orphans, and no seconds spent tearing down the interpreter.

The engine process is not daemonic (a daemonic process may not start the tensor- and pipeline-
parallel worker processes), so multiprocessing does not end it with the server; what does:

- the server stops it (``MPEngineClient.shutdown``/``kill``), also at interpreter exit (an
  ``atexit`` hook that runs before multiprocessing's own, which would otherwise join it);
- when the server dies without doing so (SIGKILL, a crash), the engine process sees EOF on its
  pipe after its current step and shuts its workers down; ``watch_parent`` is the backstop for an
  engine that is stuck: ``PARENT_GONE_GRACE_S`` after the server's death it kills its own process
  tree and exits.

A process that has finished its work leaves with ``exit_now``: the interpreter's teardown of the
torch and transformers modules (finalizer passes of the garbage collector over ~300k objects)
takes 1-4 s on a busy 2-core machine and would be paid, one after the other, by every worker,
the engine process and the server at each shutdown.
"""
from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NoReturn

PARENT_GONE_GRACE_S = 5.0  # an engine sees the server's EOF after its step; longer means stuck


def watch_parent(grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """In a spawned child: when its parent dies, allow ``grace_s`` for the child to end on its
    own, then SIGKILL the child's descendants and exit(1). No-op outside a spawned child."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # the parent's sentinel pipe closes when it exits, however it exits
        threading.Event().wait(grace_s)
        for child in child_pids(os.getpid()):
            kill_process_tree(child)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def engine_process_main(engine_main: Callable[[Any, Connection], None], engine_args: Any,
                        conn: Connection) -> NoReturn:
    """The engine process's target: ``engine_main`` (engine_client.py's loop, passed in so this
    module imports nothing of the server) under the parent watch, then a quick exit
    (``engine_main`` has shut the engine and its workers down when it returns)."""
    watch_parent()
    engine_main(engine_args, conn)
    exit_now(0)


def stop_at_exit(process: Any) -> None:
    """Kill ``process`` (and its descendants) if it still runs when this interpreter exits.
    Registered after ``process.start()``, so it runs before multiprocessing's exit hook, which
    joins non-daemonic children and would wait for it forever."""
    def stop() -> None:
        if process.pid is not None and process.is_alive():
            kill_process_tree(process.pid)
            process.join(5)

    atexit.register(stop)


def exit_now(code: int) -> NoReturn:
    """Flush the logs and standard streams, then leave without the interpreter's teardown. For a
    process whose resources are already released (children stopped, sockets closed)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def skip_teardown_collections() -> None:
    """Freeze every live object so that the collections of the interpreter's teardown skip
    them (``exit_now`` for a process that must still run its ``atexit`` hooks)."""
    gc.freeze()


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (Linux /proc; elsewhere just ``pid``)."""
    for child in child_pids(pid):
        kill_process_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def child_pids(pid: int) -> list[int]:
    """The pids of the direct children of ``pid`` (Linux /proc; [] elsewhere)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found
