"""LoRA on the cuda (or rocm) backend: the Triton shrink/expand compiled for the GPU, inside CUDA
graphs. Greedy tokens of a batch mixing adapters and the base model equal transformers + PEFT on
the GPU (float32, graphs on and off), graphs replay decode steps with adapters in them, and an
adapter swapped into a slot after capture is what a replayed graph computes. Needs a GPU."""
from __future__ import annotations

import gc

import pytest
import torch

from lora_helpers import DENSE_TARGETS, hf_lora_greedy, lora_prompts, make_adapter
from pagedllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
DEVICE = "rocm" if getattr(torch.version, "hip", None) else "cuda"
TOKENS = 16
# head size 64: a size the csrc/ decode kernel is compiled for
KERNEL_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def setup(checkpoint_factory, tmp_path_factory):
    base = checkpoint_factory("llama", **KERNEL_SHAPE)
    root = tmp_path_factory.mktemp("cuda-adapters")
    paths = [make_adapter(base, str(root / f"a{i}"), targets=DENSE_TARGETS, r=(8, 16, 4)[i],
                          seed=40 + i) for i in range(3)]
    ps = lora_prompts()
    want = {None: hf_lora_greedy(base, None, ps, TOKENS)}
    for path in paths:
        want[path] = hf_lora_greedy(base, path, ps, TOKENS)
    return base, paths, ps, want


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_mixed_batch_matches_transformers_peft(setup, enforce_eager: bool) -> None:
    base, paths, ps, want = setup
    llm = LLM(base, device=DEVICE, dtype="float32", gpu_memory_utilization=0.3,
              enforce_eager=enforce_eager, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=16)
    try:
        reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        batch, loras, keys = [], [], []
        for j, p in enumerate(ps):
            for key, req in [(None, None), *zip(paths, reqs)]:
                batch.append({"prompt_token_ids": p})
                loras.append(req)
                keys.append((key, j))
        outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=TOKENS,
                                                  ignore_eos=True),
                            lora_request=loras, use_tqdm=False)
        for (key, j), out in zip(keys, outs):
            assert list(out.outputs[0].token_ids) == want[key][j], (key, j)
        counters = llm.llm_engine.executor.worker.counters
        if not enforce_eager:
            assert counters["graph_captures"] > 0 and counters["graph_replays"] > 0
    finally:
        llm.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
