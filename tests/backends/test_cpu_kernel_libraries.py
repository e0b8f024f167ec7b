"""The cpu kernels load per library (backends/cpu/kernels.py, issue 40 item 3): a model run loads
(and on a first run builds) only the attention and layer-op libraries; another library loads
alone, in any order, when its path asks for it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.backends.cpu import kernels

_RUN = """
import json
from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu import kernels
llm = LLM({model!r}, device="cpu", dtype="float32", kv_cache_space_gib=0.05)
out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
print("RESULT", json.dumps(dict(loaded=sorted(kernels.loaded_libraries()),
                                tokens=len(out[0].outputs[0].token_ids))))
"""
_MOE_ALONE = """
import json
from pagedllm.backends.cpu import kernels
ops = kernels.load_cpu_kernels(kernels.MOE)
print("RESULT", json.dumps(dict(loaded=sorted(kernels.loaded_libraries()),
                                op=hasattr(ops, "fused_moe_packed"))))
"""


def _result(code: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDLLM_CPU_OMP_THREADS_BIND", None)  # binding would load the threads library
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_model_run_loads_only_the_core_libraries(cpu_kernels, llama_path: str) -> None:
    got = _result(_RUN.format(model=llama_path))
    assert got == {"loaded": sorted(kernels.CORE), "tokens": 4}


def test_a_library_loads_alone(cpu_kernels) -> None:
    """The MoE library before the one that defines the op namespace: its ops register."""
    assert _result(_MOE_ALONE) == {"loaded": [kernels.MOE], "op": True}


def test_an_unknown_library_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="pagedllm_cpu_nope.*known: pagedllm_cpu, "):
        kernels.load_cpu_kernels("pagedllm_cpu_nope")
