"""The cuda (or rocm) backend end to end: HF equality and CUDA graphs vs eager. Needs a GPU."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

DEVICE = "rocm" if getattr(torch.version, "hip", None) else "cuda"
MODES = {
    "plain": dict(),
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4),
    "preempt_swap": dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="swap"),
    "preempt_recompute": dict(num_gpu_blocks_override=12, max_model_len=128),
}


# head size 64: a size the decode kernel is compiled for (the default tiny checkpoints have 16)
KERNEL_SHAPE = dict(hidden_size=128, num_attention_heads=2)


def kernel_checkpoint(factory, arch: str, **overrides: object) -> str:
    kv = {} if arch == "opt" else dict(num_key_value_heads=1)  # GQA 2:1 where the arch has it
    return factory(arch, **KERNEL_SHAPE, **kv, **overrides)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Each LLM takes a share of the GPU for its KV cache; give it back between tests."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randint(3, 258) for _ in range(n)] for n in (5, 17, 33, 2, 64, 100, 40)]


def hf_greedy(path: str, ps: list[list[int]], dtype: torch.dtype, n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda")
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device="cuda"), generation_config=cfg)[0, len(p):]
                .tolist() for p in ps]


def run(path: str, n: int, ps: list[list[int]] | None = None,
        **kw: object) -> tuple[dict, list[list[int]]]:
    """Greedy ids, and facts about the engine; the engine is gone when this returns (each one
    sizes its KV cache from what the GPU has free, so two must not be alive at once)."""
    llm = LLM(path, device=DEVICE, gpu_memory_utilization=0.3, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps or prompts()],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    graphs = getattr(engine.executor.worker, "graphs", None)
    facts = dict(stats=engine.stats(), attention_backend=engine.config.attention_backend,
                 graphs=graphs is not None, steps_ahead=engine.num_steps_ahead,
                 graph_contexts=graphs.context_lens if graphs is not None else None)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return facts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_float32_greedy_matches_transformers(checkpoint_factory, arch: str, mode: str) -> None:
    path = kernel_checkpoint(checkpoint_factory, arch)
    expected = hf_greedy(path, prompts(), torch.float32, 24)
    facts, got = run(path, 24, dtype="float32", **MODES[mode])
    assert got == expected
    s = facts["stats"]
    assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks
    if mode.startswith("preempt"):
        assert s.num_preemptions > 0


# sliding windows shorter than the prompts (Mistral: every layer; Gemma: alternating with global
# layers) and soft caps (Gemma 2), head size 64 so the decode kernel and the Triton prefill run them
WINDOWED = {"gemma2": ("gemma2", dict(head_dim=64)), "gemma3": ("gemma3", dict(head_dim=64)),
            "mistral_window7": ("mistral", dict(sliding_window=7))}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(WINDOWED))
def test_window_and_soft_cap_models_match_transformers(checkpoint_factory, case: str,
                                                       mode: str) -> None:
    arch, overrides = WINDOWED[case]
    path = kernel_checkpoint(checkpoint_factory, arch, **overrides)
    expected = hf_greedy(path, prompts(), torch.float32, 24)
    facts, got = run(path, 24, dtype="float32", **MODES[mode])
    assert facts["attention_backend"] != "torch"  # the kernels, not the fallback
    assert got == expected


@pytest.mark.parametrize("case", ["gemma2", "mistral_window7"])
def test_window_models_graphs_match_eager(checkpoint_factory, case: str) -> None:
    arch, overrides = WINDOWED[case]
    path = kernel_checkpoint(checkpoint_factory, arch, **overrides)
    _, eager = run(path, 40, dtype="bfloat16", enforce_eager=True, max_num_seqs=16)
    facts, graphs = run(path, 40, dtype="bfloat16", enforce_eager=False, max_num_seqs=16)
    assert facts["graphs"] and graphs == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_graphs_match_eager(checkpoint_factory, dtype: str) -> None:
    path = kernel_checkpoint(checkpoint_factory, "llama", num_hidden_layers=3)
    _, eager = run(path, 40, dtype=dtype, enforce_eager=True, max_num_seqs=16)
    facts, graphs = run(path, 40, dtype=dtype, enforce_eager=False, max_num_seqs=16)
    assert facts["graphs"]
    assert graphs == eager


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_sequence_gemv_graphs_match_eager(checkpoint_factory, dtype: str) -> None:
    """Batch 1 (where the decode linears run the csrc/ GEMV on sm_90+; Qwen2 for the qkv bias):
    CUDA graphs, with the GEMV starting before the kernel ahead of it has finished, give the
    tokens of eager steps."""
    path = kernel_checkpoint(checkpoint_factory, "qwen2", num_hidden_layers=3)
    ps = [prompts()[5]]
    _, eager = run(path, 48, ps, dtype=dtype, enforce_eager=True)
    facts, graphs = run(path, 48, ps, dtype=dtype)
    assert facts["graphs"]
    assert graphs == eager


@pytest.mark.parametrize("mode", ["plain", "prefix_caching", "chunked_prefill"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_rotary_cache_write_matches_separate_ops(checkpoint_factory, monkeypatch,
                                                       dtype: str, mode: str) -> None:
    """In half precision the cuda attention rotates q/k and writes the cache in one kernel
    (forward_rotary); the template's separate rotary op and write_kv must give the same tokens."""
    from pagedllm.backends.attention import AttentionImpl
    from pagedllm.backends.cuda.attention import CudaPagedAttention

    path = kernel_checkpoint(checkpoint_factory, "llama", num_hidden_layers=3)
    ps = prompts() + [prompts()[4][:48] + [7, 8, 9]]  # shares 3 blocks with prompt 4 (prefix hits)
    kw = {"dtype": dtype, "max_num_seqs": 16, **MODES[mode]}
    _, fused = run(path, 32, ps, **kw)
    monkeypatch.setattr(CudaPagedAttention, "forward_rotary", AttentionImpl.forward_rotary)
    _, separate = run(path, 32, ps, **kw)
    assert fused == separate


def test_long_contexts_and_steps_ahead_match_eager(checkpoint_factory) -> None:
    """Contexts crossing the decode kernel's 256/512-token partitions (every captured context bucket),
    and steps scheduled ahead of the device (the default here) vs each step waiting."""
    path = kernel_checkpoint(checkpoint_factory, "llama", num_hidden_layers=2,
                             max_position_embeddings=1024)
    rng = random.Random(2)
    ps = [[rng.randint(3, 258) for _ in range(n)] for n in (495, 12, 600, 300, 508)]
    kw = dict(dtype="bfloat16", max_num_seqs=8)
    _, eager = run(path, 30, ps, enforce_eager=True, disable_async_output_proc=True, **kw)
    facts, graphs = run(path, 30, ps, **kw)
    assert facts["graph_contexts"] == [256, 512, 1024] and facts["steps_ahead"] > 10
    assert graphs == eager
    _, waiting = run(path, 30, ps, disable_async_output_proc=True, **kw)
    assert waiting == graphs


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_programmatic_launch_matches_plain_launches(checkpoint_factory, enforce_eager: bool) -> None:
    """With programmatic dependent launch (sm_90+) a kernel starts while the one before it
    finishes and waits for it inside (pl_wait_prior_grids): eager and in CUDA graphs, over one
    and several decode partitions, the tokens must be those of plain launches."""
    from pagedllm.backends.cuda import ops

    kernels = ops.load_kernels()
    if not kernels.configure_programmatic_launch(True):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU and CUDA")
    path = kernel_checkpoint(checkpoint_factory, "llama", num_hidden_layers=3,
                             max_position_embeddings=1024)
    rng = random.Random(3)
    ps = prompts() + [[rng.randint(3, 258) for _ in range(n)] for n in (600, 300)]
    kw = dict(dtype="bfloat16", max_num_seqs=16, enforce_eager=enforce_eager,
              enable_prefix_caching=True)
    try:
        _, programmatic = run(path, 40, ps, **kw)
        assert kernels.programmatic_launch_enabled()
        kernels.configure_programmatic_launch(False)
        _, plain = run(path, 40, ps, **kw)
    finally:
        ops._configure_launch(kernels)
    assert programmatic == plain


def test_unsupported_head_size_falls_back_to_torch_attention(checkpoint_factory) -> None:
    path = checkpoint_factory("llama")  # head size 16: no kernel
    expected = hf_greedy(path, prompts(), torch.float32, 16)
    facts, got = run(path, 16, dtype="float32")
    assert facts["attention_backend"] == "torch" and not facts["graphs"]
    assert got == expected
    with pytest.raises(ValueError, match="head_size=16"):
        LLM(path, device=DEVICE, dtype="float32", attention_backend="kernels")


def test_backend_reports_available() -> None:
    from pagedllm.backends.registry import resolve_backend

    backend = resolve_backend("auto")
    assert backend.name == DEVICE and backend.availability()[0]
