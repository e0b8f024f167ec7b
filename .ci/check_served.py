"""Waits for a pagedllm server on 127.0.0.1 and checks that it completes a prompt (containers leg)."""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            if _get(f"{base}/health") == 200:
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            print(f"no healthy server on {base} after {args.timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(1.0)
    body = json.dumps({"model": "pagedllm-demo", "prompt": "def fibonacci(n):",
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.load(resp)
    text = out["choices"][0]["text"]
    tokens = out["usage"]["completion_tokens"]
    if tokens < 1 or not text:
        print(f"empty completion: {out}", file=sys.stderr)
        return 1
    print(f"completion ({tokens} tokens): {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
