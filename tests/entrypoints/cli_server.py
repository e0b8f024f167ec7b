"""``pagedllm serve ARGV...`` as a subprocess with the argv exactly as given (flag order matters to
some tests), on a free port, on the cpu backend; for the tests of the CLI's edges."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pagedllm.entrypoints.openai.lifecycle import child_pids as children

STARTUP_TIMEOUT_S = 300.0  # a TP=2 server took ~140 s to start under a load of 17


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_ready(server: Any) -> None:
    """Until ``server`` (``.proc``, ``.base_url``, ``.logs()``, ``.stop()``) answers GET /health
    with 200; raises with its log when it exits first or is not ready in STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.logs()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    logs = server.logs()
    server.stop()
    raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{logs}")


class CliProcess:
    """``pagedllm ARGV... --port P`` (serve, proxy, ...) as a subprocess on a free port, its output
    in a log file; ``wait_ready()`` until it answers GET /health."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 drop_env: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base_url = self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **(env or {}))
        for name in drop_env:
            env.pop(name, None)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv,
                                      "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> CliProcess:
        wait_ready(self)
        return self

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def kill(self) -> None:
        """SIGKILL, the engine process included: a crash, nothing cleaned up."""
        if self.proc.poll() is None:
            for pid in children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> int | None:
        """SIGTERM (a clean shutdown), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode


class CliServer(CliProcess):
    """``pagedllm serve ARGV... --device cpu --dtype float32``, ready when constructed; ``stop``
    kills it (the tests of shutdown paths send their own signals first)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None
                 ) -> None:
        super().__init__(["serve", *argv, "--device", "cpu", "--dtype", "float32",
                          "--disable-uvicorn-access-log"], log_path, env)
        wait_ready(self)

    def stop(self) -> int | None:
        self.kill()
        self._log.close()
        return self.proc.returncode
