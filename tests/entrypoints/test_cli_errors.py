"""Issue 28 items 4-5: ``pagedllm generate`` and ``pagedllm bench`` report a bad argument as one
ERROR line naming it (no traceback), exit 2 for usage errors and 1 for runtime ones; a bad
--tokenizer is named as the tokenizer. The CLI runs as a subprocess, as a user runs it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = [  # (argv, exit status, what the one error line must say)
    (["generate", "--temperature", "-1", "hi"], 2, "temperature=-1.0 is invalid"),
    (["generate", "--max-model-len", "99999", "hi"], 2, "max_model_len=99999 is invalid"),
    (["generate", "--model", "/nonexistent", "hi"], 2, "model='/nonexistent' is not a local"),
    (["generate", "--tokenizer", "/nonexistent", "hi"], 2,
     "tokenizer='/nonexistent' is not a local"),
    (["generate", "--device", "npu", "hi"], 2, "device='npu' is not a known backend"),
    (["generate"], 2, "no prompt"),
    (["bench", "--num-prompts", "0"], 2, "--num-prompts must be >= 1"),
]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("argv, status, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_argument_is_one_error_line(argv: list[str], status: int, message: str) -> None:
    out = _run(argv)
    text = out.stdout + out.stderr
    assert out.returncode == status, text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], text


@pytest.mark.parametrize("argv, flag", [(["generate", "--dtype", "foo", "hi"], "--dtype"),
                                        (["generate", "--block-size", "7", "hi"], "--block-size"),
                                        (["bench", "--dtype", "foo"], "--dtype"),
                                        (["generate", "hi", "--model"], "--model")])
def test_usage_error_names_the_flag(argv: list[str], flag: str) -> None:
    out = _run(argv)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: argument {flag}" in out.stderr, out.stderr


def test_unavailable_device_is_a_runtime_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("cuda is available here")
    out = _run(["generate", "--device", "cuda", "hi"])
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "device='cuda' is not available" in errors[0], text
