"""Issue 28 items 3 and 8 on a real ``pagedllm serve`` process: a MODEL after
--served-model-name is served (not swallowed into the names), every nargs flag of serve and
generate is known; HEAD /health, /ping, GET /v1/models/{id}, a case-insensitive bearer scheme,
an aborted request logged like a finished one, one timestamped log format."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cli_server import CliServer

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pagedllm.testing.checkpoints import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("edges")), "llama",
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    s = CliServer([model, "--api-key", "secret", "--served-model-name", "a", "b",
                   "--num-gpu-blocks-override", "512", "--max-num-seqs", "4"],
                  tmp_path_factory.mktemp("edges-log") / "server.log")
    yield s
    s.stop()


def test_model_after_served_model_name_is_served(model: str, tmp_path: Path) -> None:
    s = CliServer(["--served-model-name", "mymodel", model], tmp_path / "server.log")
    try:
        cards = httpx.get(f"{s.base_url}/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [("mymodel", model)]
        r = httpx.post(f"{s.base_url}/v1/completions", timeout=60,
                       json={"model": "mymodel", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_every_nargs_flag_is_known() -> None:
    """The variadic flags of serve are --served-model-name (the test above) and --lora-modules
    (test_model_after_lora_modules_is_served); a new one must be handled the same way (and added
    here)."""
    from pagedllm.entrypoints.cli import make_parser

    sub = next(a for a in make_parser()._actions if a.dest == "command")
    variadic = {name: sorted(s for a in sub.choices[name]._actions if a.option_strings
                             and a.nargs in ("+", "*") for s in a.option_strings)
                for name in ("serve", "generate", "bench")}
    assert variadic == {"serve": ["--lora-modules", "--served-model-name"], "generate": [],
                        "bench": []}


def test_model_after_lora_modules_is_served(model: str) -> None:
    """`serve --enable-lora --lora-modules a=/x MODEL`: the list gives MODEL back; a bad entry is
    a usage error naming the flag."""
    import argparse

    from pagedllm.entrypoints.cli import make_parser
    from pagedllm.entrypoints.openai.cli_args import validate_args

    parser = make_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    args = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y", model])
    validate_args(args, sub)
    assert args.model == model
    assert [(m.name, m.path) for m in args.lora_modules] == [("a", "/x"), ("b", "/y")]
    args = parser.parse_args(["serve", model, "--enable-lora", "--lora-modules", "nonsense"])
    with pytest.raises(SystemExit):
        validate_args(args, sub)
    assert isinstance(sub, argparse.ArgumentParser)


def test_health_head_and_ping_without_a_key(server: CliServer) -> None:
    assert httpx.head(f"{server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.base_url}/ping", timeout=10).status_code == 200


@pytest.mark.parametrize("value, status", [("Bearer secret", 200), ("bearer secret", 200),
                                           ("BEARER  secret", 200), ("Bearer Secret", 401),
                                           ("secret", 401), ("Basic secret", 401)])
def test_bearer_scheme_is_case_insensitive(server: CliServer, value: str, status: int) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": value}, timeout=10)
    assert r.status_code == status, r.text


def test_model_by_id(server: CliServer) -> None:
    auth = {"Authorization": "Bearer secret"}
    card = httpx.get(f"{server.base_url}/v1/models/b", headers=auth, timeout=10).json()
    assert card["id"] == "b" and card["object"] == "model"
    r = httpx.get(f"{server.base_url}/v1/models/nope", headers=auth, timeout=10)
    assert r.status_code == 404
    error = r.json()["error"]
    assert "`nope`" in error["message"] and error["param"] == "model"


def test_disconnect_is_logged_like_a_finish_and_every_line_is_timestamped(
        server: CliServer) -> None:
    body = {"model": "a", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer secret"}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[6:])["id"]
    deadline = time.monotonic() + 30
    while f"finished request {request_id}: abort" not in server.logs():
        assert time.monotonic() < deadline, server.logs()[-3000:]
        time.sleep(0.2)
    lines = [ln for ln in server.logs().splitlines() if re.search(r"\b(INFO|WARNING|ERROR)\b", ln)]
    assert lines and all(LOG_LINE.match(ln) for ln in lines), \
        [ln for ln in lines if not LOG_LINE.match(ln)][:5]


def _timed_out_choices(server: CliServer, stream: bool) -> list[tuple[int, str]]:
    body = {"model": "a", "prompt": "hi", "max_tokens": 8, "n": 3, "temperature": 1.0,
            "timeout_seconds": 0.3, "stream": stream}
    auth = {"Authorization": "Bearer secret"}
    if not stream:
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        return sorted((c["index"], c["finish_reason"]) for c in r.json()["choices"])
    got = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=auth,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += [(c["index"], c["finish_reason"]) for c in json.loads(line[6:])["choices"]
                        if c["finish_reason"] is not None]
    return sorted(got)


def test_n_choices_time_out_before_scheduling(server: CliServer) -> None:
    """Issue 28 item 6 through the server: a request with n=3 that waits (the server's 4
    sequence slots are taken) past its timeout returns every one of the n choices as "timeout"."""
    busy = {"model": "a", "prompt": "busy", "max_tokens": 1500, "n": 4, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=busy, timeout=60,
                      headers={"Authorization": "Bearer secret"}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the 4 slots are running
        for stream in (False, True):
            assert _timed_out_choices(server, stream) == [(i, "timeout") for i in range(3)]
