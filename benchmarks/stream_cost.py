"""Does streaming a long completion cost the same per token at the end as at the start?
(issue 42: the server must stream without re-accumulating, O(new tokens) per step.)

Starts ``pagedllm serve`` on a tiny random-weight Llama (or ``--model``), streams one
``/v1/completions`` request of ``--tokens`` tokens (greedy, ignore_eos) and, over the first and
the last ``--window`` tokens, reports per token: the client's wall time, the CPU time of the
API server process (HTTP, SSE, the engine client) and of the engine process (the model and
the output processing), and the last/first ratio of each.

    python benchmarks/stream_cost.py --tokens 4000 --window 500 [--logprobs 2]

The engine's own work per token grows with the context (attention reads every earlier
token); the API server's should not.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(max_len: int) -> str:
    from pagedllm.testing.checkpoints import make_checkpoint

    path = Path(tempfile.gettempdir()) / f"pagedllm-stream-cost-{max_len}"
    if not (path / "config.json").exists():
        make_checkpoint(str(path), "llama", max_position_embeddings=max_len)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: a tiny random-weight Llama")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--logprobs", type=int, default=None)
    args = ap.parse_args()
    max_len = args.tokens + 64
    model = args.model or tiny_model(max_len)
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / "pagedllm-stream-cost.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--device", "cpu",
         "--dtype", "float32", "--port", str(port), "--max-model-len", str(max_len),
         "--disable-log-requests", "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (see {log.name})")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        engine = children(server.pid)
        body = {"model": model, "prompt": "hello", "max_tokens": args.tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True}
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
        marks = {0: None, args.window: None, args.tokens - args.window: None, args.tokens: None}
        received = 0

        def mark() -> tuple[float, float, float]:
            return (time.perf_counter(), cpu_seconds(server.pid),
                    sum(cpu_seconds(p) for p in engine))

        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=None) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:  # one step's tokens: one here (greedy, n=1)
                    received += len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 1
                for k in marks:
                    if marks[k] is None and received >= k:
                        marks[k] = mark()
        if received < args.tokens:
            raise RuntimeError(f"received {received} of {args.tokens} tokens")
    finally:
        server.terminate()
        server.wait(30)
    w = args.window
    (t0, s0, e0), (t1, s1, e1) = marks[0], marks[w]
    (t2, s2, e2), (t3, s3, e3) = marks[args.tokens - w], marks[args.tokens]
    rows = [("client wall ms/token", (t1 - t0) / w, (t3 - t2) / w),
            ("API server CPU ms/token", (s1 - s0) / w, (s3 - s2) / w),
            ("engine process CPU ms/token", (e1 - e0) / w, (e3 - e2) / w)]
    print(f"{args.tokens} tokens streamed to one client (logprobs={args.logprobs}); "
          f"first {w} vs last {w} tokens")
    print(f"{'':30s} {'first':>8s} {'last':>8s} {'last/first':>10s}")
    for name, first, last in rows:
        ratio = last / first if first > 0 else float("nan")
        print(f"{name:30s} {first * 1e3:8.3f} {last * 1e3:8.3f} {ratio:10.2f}")


if __name__ == "__main__":
    main()
