"""A real server process on 127.0.0.1 over a tiny checkpoint, shared by the tests of a session.

``start_server(*flags)`` starts another one (auth, shutdown tests); each is stopped at teardown.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cli_server import free_port, wait_ready  # one launcher helper for both

MAX_MODEL_LEN = 512
NUM_BLOCKS = 512


class ServerProcess:
    """``python -m pagedllm.entrypoints.openai.api_server MODEL --device cpu ...`` in a subprocess."""

    def __init__(self, model: str, flags: tuple[str, ...], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", model,
               "--device", "cpu", "--dtype", "float32", "--port", str(self.port),
               "--disable-uvicorn-access-log", *flags]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        wait_ready(self)

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Prometheus samples by name (labels dropped; every sample here has one label set)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                if "finished_reason" in sample.labels:
                    key += f"{{{sample.labels['finished_reason']}}}"
                values[key] = sample.value
        return values

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Its tokenizer's model_max_length is the context, as a real model's is (transformers then
    warns when it encodes a longer text; the server must not let that reach its log)."""
    import json

    from pagedllm.testing.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path_factory.mktemp("serve-tiny")), "llama",
                           max_position_embeddings=MAX_MODEL_LEN)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "model_max_length": MAX_MODEL_LEN}))
    return path


@pytest.fixture(scope="session")
def start_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server-log") / "server.log"
        server = ServerProcess(tiny_model, ("--num-gpu-blocks-override", str(NUM_BLOCKS), *flags),
                               log)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The shared server: defaults (max n 16, max logprobs 20), 512 KV blocks, max_model_len 512."""
    return start_server("--served-model-name", "tiny", "tiny-alias")


@pytest.fixture
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c
