"""Greedy output equals Hugging Face transformers' token for token (float32), for every
architecture, with and without prefix caching, chunked prefill and preemption."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "mistral", "opt"]
# case -> (family, config overrides): sliding windows smaller than every long prompt, on every
# layer (Mistral) or from max_window_layers on (Qwen2)
CASES: dict[str, tuple[str, dict]] = {arch: (arch, {}) for arch in ARCHS}
CASES.update({
    "mistral_window6": ("mistral", dict(sliding_window=6)),
    "qwen2_window5": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # sliding/global layers, soft caps, local/global rope (testing/checkpoints.py)
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
})
MAX_TOKENS = 20
MODES = {
    "plain": dict(),
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4),
    "preempt_recompute": dict(num_gpu_blocks_override=12, max_model_len=128,
                              preemption_mode="recompute"),
    "preempt_swap": dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="swap"),
}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randint(3, 258) for _ in range(40)]
    mixed = [[rng.randint(3, 258) for _ in range(n)] for n in (5, 17, 33, 2, 64)]
    # two prompts sharing a 32-token prefix with the first mixed one, for prefix-cache hits
    return mixed + [base, base[:32] + [7, 8, 9]]


def hf_greedy(path: str, ps: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in ps]


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    cache: dict[str, list[list[int]]] = {}

    def get(case: str) -> tuple[str, list[list[int]]]:
        family, overrides = CASES[case]
        path = checkpoint_factory(family, **overrides)
        if case not in cache:
            cache[case] = hf_greedy(path, prompts())
        return path, cache[case]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(CASES))
def test_greedy_matches_transformers(arch: str, mode: str, reference) -> None:
    path, expected = reference(arch)
    llm = LLM(path, device="cpu", dtype="float32", **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if mode == "prefix_caching":  # a second pass reads the prompts' KV from the cache
        hits_before = llm.llm_engine.block_manager.num_prefix_hit_blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.llm_engine.block_manager.num_prefix_hit_blocks > hits_before
    if arch == "mistral_window6":  # every layer windowed: blocks behind the window freed early
        assert llm.llm_engine.block_manager.num_slid_out_blocks > 0
    stats = llm.llm_engine.stats()
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    if mode == "prefix_caching":
        assert stats.num_cached_blocks > 0


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_each_cpu_attention_matches_transformers(attention: str, reference,
                                                 request: pytest.FixtureRequest) -> None:
    """The cpu attentions by name: the tests above run the default, which is "native" (C++
    decode) where its kernels build and "torch" (the reference) elsewhere."""
    if attention == "native":
        request.getfixturevalue("cpu_kernels")  # skips where the kernels cannot be built
    path, expected = reference("llama")
    llm = LLM(path, device="cpu", dtype="float32", attention_backend=attention,
              **MODES["prefix_caching"])
    assert llm.llm_engine.executor.worker.attn_cls.name == attention
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second pass decodes after prefix-cache hits
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_pytorch_bin_checkpoint_loads_with_weights_only(tmp_path, reference) -> None:
    """A .bin checkpoint (torch.load(weights_only=True)) gives the same tokens."""
    import glob
    import os
    import shutil

    from safetensors.torch import load_file

    path, expected = reference("llama")
    shutil.copytree(path, tmp_path / "bin", ignore=shutil.ignore_patterns("*.safetensors"))
    state = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(f))
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    llm = LLM(str(tmp_path / "bin"), device="cpu", dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
