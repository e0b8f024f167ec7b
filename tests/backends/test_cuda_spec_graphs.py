"""Speculative decoding's target steps on CUDA graphs (backends/cuda/spec_graphs.py): plain and
verification steps replay captured graphs and give the tokens plain decoding gives. Needs a GPU
(the layout itself is tested eagerly on the cpu: tests/spec_decode/test_step_graphs.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.demo import DEMO_DIR

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

DEVICE = "rocm" if getattr(torch.version, "hip", None) else "cuda"
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
           "def fib(n):\n    if n < 2:\n        return n\n    return ",
           "for i in range(10):\n    print(i)\n    print(i)\n    print(",
           "x = 1\n"]
K = 4


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
@pytest.mark.parametrize("batch", [1, 5])
def test_speculative_steps_replay_graphs_with_plain_tokens(method: str, batch: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS[:batch]
    plain = LLM(DEMO_DIR, device=DEVICE, dtype="float32", seed=0, max_num_seqs=8)
    want = _tokens(plain, prompts, params)
    plain.shutdown()
    del plain
    gc.collect()
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    llm = LLM(DEMO_DIR, device=DEVICE, dtype="float32", seed=0, max_num_seqs=8,
              speculative_config=spec)
    graphs = llm.llm_engine.executor.worker.spec_graphs
    assert graphs is not None and any(q == K + 1 for _, q, _ in graphs.graphs)
    got = _tokens(llm, prompts, params)
    llm.shutdown()
    assert got == want
    assert graphs.steps[K + 1] > 0, "no verification step replayed a graph"
