"""examples/ runs as a user runs it: each script a real subprocess on the built-in demo model, the
OpenAI one against the real `pagedllm serve` it starts on 127.0.0.1; the server's greedy
completions equal the offline ones for the same prompts."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = "8"
# float32: the token-for-token comparison does not hinge on a bfloat16 route chosen by timing
ARGS = ["--dtype", "float32", "--max-tokens", MAX_TOKENS]
_BLOCK = re.compile(r"^=== (.*?)\n(.*?)(?=^=== |\Z)", re.S | re.M)


def _run(script: str) -> dict[str, str]:
    """The script's output blocks, title -> text."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script), *ARGS], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {title: text.rstrip("\n") for title, text in _BLOCK.findall(res.stdout)}


def _greedy(blocks: dict[str, str]) -> dict[str, str]:
    """'greedy PROMPT (reason, n tokens)' blocks -> {PROMPT: text}; the token count checked."""
    out = {}
    for title, text in blocks.items():
        m = re.fullmatch(r"greedy (.+) \((\w+), (\d+) tokens\)", title)
        if m:
            assert m.group(3) == MAX_TOKENS and m.group(2) == "length", title
            out[m.group(1)] = text
    return out


def test_offline_and_openai_examples_agree() -> None:
    offline = _run("offline_inference.py")
    served = _run("openai_client.py")
    greedy = _greedy(offline)
    assert len(greedy) == 3 and all(greedy.values()), offline
    assert _greedy(served) == greedy  # same prompts, same model, greedy: same text
    samples = [t for k, t in offline.items() if k.startswith("sample ")]
    assert len(samples) == 2 and all(samples)
    chat = next(t for k, t in offline.items() if k.startswith("chat "))
    assert chat and next(t for k, t in served.items() if k.startswith("chat ")) == chat
    assert next(t for k, t in served.items() if k.startswith("streamed chat ")) == chat
    assert served.get("model pagedllm-demo") is not None
