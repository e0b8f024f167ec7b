"""The official OpenAI Python client against ``pagedllm serve``: models, completions, chat,
streaming.

    python examples/openai_client.py                 # starts `pagedllm serve` (demo model) on
                                                     # 127.0.0.1, a free port; stops it at the end
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1   # a running server
    python examples/openai_client.py --model /path/to/hf/checkpoint        # served by the script

``pip install openai`` (it is in the test extras). With the default greedy settings the
completions are what ``examples/offline_inference.py`` prints for the same prompts.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from openai import OpenAI

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT = [{"role": "system", "content": "You write small Python helpers."},
        {"role": "user", "content": "Read a file and return its lines."}]


@contextlib.contextmanager
def pagedllm_server(model: str, dtype: str, timeout_s: float = 600.0) -> Iterator[str]:
    """``pagedllm serve MODEL`` on 127.0.0.1 and a free port; yields its /v1 URL; the first
    SIGINT at exit drains and stops it, as Ctrl-C would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host",
           "127.0.0.1", "--port", str(port), "--dtype", dtype, "--disable-uvicorn-access-log"]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # /health answers once the engine is loaded
            if server.poll() is not None:
                raise SystemExit(f"pagedllm serve exited with status {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"pagedllm serve not ready after {timeout_s:.0f} s")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def run(client: OpenAI, max_tokens: int) -> None:
    model = client.models.list().data[0].id  # the served model's name
    print(f"=== model {model}")
    for prompt in PROMPTS:
        done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0.0)
        choice = done.choices[0]
        print(f"=== greedy {prompt!r} ({choice.finish_reason}, "
              f"{done.usage.completion_tokens} tokens)\n{choice.text}")

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_tokens,
                                          temperature=0.0)
    print(f"=== chat ({chat.choices[0].finish_reason})\n{chat.choices[0].message.content}")

    # the same conversation streamed: the deltas arrive as the engine produces them
    pieces = []
    for chunk in client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_tokens,
                                                temperature=0.0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    print(f"=== streamed chat ({len(pieces)} chunks)\n{''.join(pieces)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server's /v1 URL (default: start one)")
    p.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    p.add_argument("--model", default="pagedllm-demo", help="what the started server serves")
    p.add_argument("--dtype", default="auto", help="the started server's --dtype")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if args.base_url:
        run(OpenAI(base_url=args.base_url, api_key=args.api_key), args.max_tokens)
        return
    with pagedllm_server(args.model, args.dtype) as base_url:
        run(OpenAI(base_url=base_url, api_key=args.api_key), args.max_tokens)


if __name__ == "__main__":
    main()
