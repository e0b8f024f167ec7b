"""The Python API gets the OpenMP spin policy whatever the script imported first (issue 40 item 9):
``import pagedllm`` sets GOMP_SPINCOUNT before torch loads; a script that imported torch first
gets its cpu worker in a fresh interpreter started with the variable
(pagedllm/executor/worker_process.py). Real subprocesses running user scripts, no main guard."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedllm.entrypoints.omp_env import DEFAULT_SPINCOUNT, SPINCOUNT_ENV, WAIT_POLICY_ENV

# a user's script: no `if __name__ == "__main__":` guard (a spawn child would run it again)
_SCRIPT = """
{first}
import json, os, signal
from pagedllm import LLM, SamplingParams

llm = LLM({model!r}, dtype="float32", kv_cache_space_gib=0.05, seed=0)
workers = [w.process.pid for w in getattr(llm.llm_engine.executor, "workers", [])]
environ = {{}}
for pid in workers:
    with open(f"/proc/{{pid}}/environ", "rb") as f:
        environ = dict(kv.split("=", 1) for kv in f.read().decode().split("\\0") if "=" in kv)
params = SamplingParams(temperature=0.0, max_tokens=8)
out = llm.generate([[1, 5, 9, 13], [2, 4]], params, use_tqdm=False)
died = None
if workers:
    os.kill(workers[0], signal.SIGKILL)
    try:
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    except Exception as exc:
        died = type(exc).__name__
print("RESULT", json.dumps(dict(
    pid=os.getpid(), workers=workers, parent_spin=os.environ.get({spin!r}),
    worker_spin=environ.get({spin!r}), tokens=[list(o.outputs[0].token_ids) for o in out],
    died=died)))
"""


def _run(tmp_path: Path, model: str, first: str) -> dict:
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT.format(first=first, model=model, spin=SPINCOUNT_ENV))
    env = {k: v for k, v in os.environ.items() if k not in (SPINCOUNT_ENV, WAIT_POLICY_ENV)}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    results = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(results) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(results[0][len("RESULT "):])


def test_import_pagedllm_sets_the_spin_policy_before_torch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (SPINCOUNT_ENV, WAIT_POLICY_ENV)}
    code = "import pagedllm, os, sys; print('torch' in sys.modules, os.environ.get(%r))"
    out = subprocess.run([sys.executable, "-c", code % SPINCOUNT_ENV], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", DEFAULT_SPINCOUNT]


def test_worker_runs_apart_when_torch_came_first(tmp_path: Path, llama_path: str) -> None:
    """torch first: the worker runs in its own process, started with the variable, and gives the
    tokens of an engine in this (pagedllm-first) process; its death is reported, not hung."""
    from pagedllm import LLM, SamplingParams

    apart = _run(tmp_path, llama_path, first="import torch")
    assert apart["parent_spin"] is None  # too late for this process's libgomp
    assert len(apart["workers"]) == 1 and apart["workers"][0] != apart["pid"]
    assert apart["worker_spin"] == DEFAULT_SPINCOUNT
    llm = LLM(llama_path, dtype="float32", kv_cache_space_gib=0.05, seed=0)
    out = llm.generate([[1, 5, 9, 13], [2, 4]], SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)
    assert apart["tokens"] == [list(o.outputs[0].token_ids) for o in out]
    assert all(len(t) == 8 for t in apart["tokens"])
    assert apart["died"] == "WorkerDiedError"
