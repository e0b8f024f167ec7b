"""Issue 40 item 0: xgrammar is a default dependency, and a server whose install lacks it answers
a valid structured-output request with 501 naming the package (it was a 500
ModuleNotFoundError), says so in its start-up log, and serves everything else."""
from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest
from cli_server import CliServer

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_xgrammar_is_installed_by_default() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text())
    requires = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                    for kw in node.keywords if kw.arg == "install_requires")
    names = [ast.literal_eval(e) for e in requires.elts]
    assert any(n.startswith("xgrammar") for n in names), names


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    """A server whose Python cannot import xgrammar (as after an install without it)."""
    site = tmp_path_factory.mktemp("no-xgrammar")
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['xgrammar'] = None\n")
    server = CliServer([tiny_model, "--served-model-name", "tiny"], site / "server.log",
                       env={"PYTHONPATH": str(site)})
    yield server
    server.stop()


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "[ab]+"}, "guided_regex"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
], ids=["json_schema", "json_object", "guided_regex", "tool_choice_required"])
def test_structured_request_is_501_naming_the_package(server: CliServer, body: dict,
                                                      param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3, **body})
    assert r.status_code == 501, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "guided_decoding_unavailable"
    assert "pip install 'xgrammar" in error["message"], error


def test_the_rest_is_served_and_the_log_says_why(server: CliServer) -> None:
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    logs = server.logs()
    assert "WARNING" in logs and "xgrammar package is not installed" in logs, logs
    assert "Traceback" not in logs and "ModuleNotFoundError" not in logs, logs
