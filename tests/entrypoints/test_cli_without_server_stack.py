"""The CLI's parser and ``pagedllm backends`` work where only the engine's dependencies are
installed (the tpu and xpu CI venvs have no web stack): nothing above the engine is imported
until a command needs it."""
from __future__ import annotations

import subprocess
import sys

SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "openai", "peft")

SCRIPT = f"""
import sys
for name in {SERVER_ONLY!r}:
    sys.modules[name] = None  # importing it raises ImportError
from pagedllm.entrypoints.cli import make_parser
from pagedllm.entrypoints.openai.cli_args import validate_args
parser = make_parser()
args = parser.parse_args(["serve", "m", "--lora-modules", "a=/x", "--enable-lora"])
validate_args(args, parser)
assert args.lora_modules[0].name == "a" and args.lora_modules[0].path == "/x", args
print("ok")
"""


def test_parser_builds_without_the_web_stack() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
