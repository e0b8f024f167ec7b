"""lifecycle.py on real processes: the non-daemonic engine process cannot outlive the server.

A child that ignores its parent's death (an engine stuck in a step) is ended by ``watch_parent``
with its own children; a child still running when the parent's interpreter exits is stopped by
``stop_at_exit`` instead of multiprocessing's exit hook waiting for it forever.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_server import alive

SCRIPT = '''
import multiprocessing as mp, subprocess, sys, time
from pagedllm.entrypoints.openai import lifecycle

def stuck(watch: bool) -> None:
    """Never reads its parent: only the watch can end it (and its own child)."""
    if watch:
        lifecycle.watch_parent(grace_s=0.2)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(mp.current_process().pid, child.pid, flush=True)
    time.sleep(120)

if __name__ == "__main__":
    mode = sys.argv[1]
    proc = mp.get_context("spawn").Process(target=stuck, args=(mode == "watch",), daemon=False)
    proc.start()
    if mode == "stop_at_exit":
        lifecycle.stop_at_exit(proc)
    print(sys.stdin.readline(), flush=True)  # until the test says "exit" (or kills us)
'''


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the script failed (exit {proc.wait(30)})"
    return proc, [int(p) for p in line.split()]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_child_of_a_killed_parent_ends_itself_and_its_children(tmp_path: Path) -> None:
    parent, pids = _start(tmp_path, "watch")
    try:
        parent.kill()  # no shutdown message, no atexit hook: only the watch is left
        parent.wait(10)
        left = _wait_gone(pids, 5.0)
        assert not left, f"processes outlived their killed parent: {left}"
    finally:
        _kill(pids)


def test_running_child_is_stopped_when_the_parent_exits(tmp_path: Path) -> None:
    parent, pids = _start(tmp_path, "stop_at_exit")
    try:
        parent.stdin.write("exit\n")
        parent.stdin.flush()
        assert parent.wait(15) == 0  # multiprocessing's exit hook would join the child forever
        assert not _wait_gone(pids, 5.0), "the child (or its child) outlived the parent"
    finally:
        _kill(pids + [parent.pid])
