"""The xpu backend and its IPEX attention. Everywhere: availability reasons, lazy imports, the
attention choice on cpu. With intel_extension_for_pytorch installed (the xpu CI leg, IPEX's CPU
build): the IPEX ops against the float64 reference in every dtype and block size, the layout
check that keeps IPEX from crashing, and greedy equality with Hugging Face through
``LLM(device="cpu", attention_backend="ipex")``, the path an Intel GPU runs."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.xpu.backend import XpuBackend
from pagedllm.testing.harness import raw_config
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

CPU = torch.device("cpu")
HAVE_IPEX = importlib.util.find_spec("intel_extension_for_pytorch") is not None
needs_ipex = pytest.mark.skipif(not HAVE_IPEX, reason="needs intel_extension_for_pytorch "
                                "(the xpu CI leg installs IPEX's CPU build)")


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_ATTENTION_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.strip()


def test_unavailable_without_an_intel_gpu_says_why() -> None:
    ok, reason = XpuBackend.availability()
    if ok:
        pytest.skip("an Intel GPU is present")
    if HAVE_IPEX:
        assert "no Intel GPU" in reason and "attention_backend='ipex'" in reason
    else:
        assert "intel_extension_for_pytorch is not installed" in reason


def test_nothing_imports_ipex_until_a_layer_is_built() -> None:
    code = ("import sys; from pagedllm.backends.registry import discover; infos = discover(); "
            "[i.availability() for i in infos.values()]; "
            "from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention; "
            "print('intel_extension_for_pytorch' in sys.modules)")
    assert _python(code) == "False"


def test_attention_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.backends.cpu.attention import TorchPagedAttention

    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)  # set by --attention-backend
    from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

    cpu, xpu = CpuBackend(), XpuBackend()
    config = raw_config(cpu, dtype="float32", block_size=16)
    assert xpu.attention_cls(config) is IpexPagedAttention
    config.attention_backend = "torch"  # the default: test_cpu_native_attention.py
    assert cpu.attention_cls(config) is TorchPagedAttention
    config.attention_backend = "ipex"
    assert cpu.attention_cls(config) is IpexPagedAttention
    config.attention_backend = "flash"
    with pytest.raises(ValueError, match="allowed: native, torch, ipex"):
        cpu.attention_cls(config)
    with pytest.raises(ValueError, match="allowed: ipex, torch"):
        xpu.attention_cls(config)


def test_attention_backend_env_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "ipex")
    assert raw_config(CpuBackend(), dtype="float32", block_size=16).attention_backend == "ipex"


@pytest.mark.skipif(HAVE_IPEX, reason="IPEX is installed")
def test_ipex_attention_without_ipex_explains() -> None:
    from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

    with pytest.raises(RuntimeError, match="pip install intel-extension-for-pytorch"):
        IpexPagedAttention(4, 64, 2, 0.125)


# --- IPEX's CPU build ------------------------------------------------------------------------
def _impl(num_heads: int = 8, num_kv_heads: int = 2, head_size: int = 64):
    from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

    return IpexPagedAttention(num_heads, head_size, num_kv_heads, head_size ** -0.5)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@needs_ipex
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_ipex_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    impl = _impl()
    bs = block_size
    specs = [SeqSpec(bs, 3), SeqSpec(2 * bs + 3, bs + 2), SeqSpec(5, 9), SeqSpec(0, 6),
             SeqSpec(bs, 1), SeqSpec(3, 1), SeqSpec(0, 1)]  # cached context, fresh, decodes
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch.random(specs, num_heads=8, num_kv_heads=2, head_size=64, block_size=bs,
                              dtype=dtype, device=CPU, generator=g)
    cache = (torch.randn(impl.kv_cache_shape(batch.num_blocks, bs, 2, 64), generator=g)
             + 40.0).to(dtype)
    batch.write_context(impl, cache, CPU)
    t = batch.query.shape[0]
    got = batch.run(impl, cache, CPU, pad_tokens_to=t + 5)[:t]  # 5 pad rows, slot -1
    ref = batch.reference(impl.scale)
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.double(), ref, atol=tol, rtol=tol), (got.double() - ref).abs().max()


@needs_ipex
def test_wrong_cache_layout_is_refused_before_ipex_sees_it() -> None:
    """reshape_and_cache's docstring layout [blocks, block_size, heads, D] crashes IPEX 2.8."""
    impl = _impl(4, 2, 64)
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch.random([SeqSpec(0, 3)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, device=CPU, generator=g)
    docstring_layout = torch.zeros(2, batch.num_blocks, 16, 2, 64)
    with pytest.raises(ValueError, match="num_kv_heads, block_size, head_size"):
        impl.write_kv(batch.key, batch.value, docstring_layout, batch.step_metadata(CPU))


@needs_ipex
def test_pad_slots_are_not_written() -> None:
    impl = _impl(4, 2, 64)
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch.random([SeqSpec(0, 5)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, device=CPU, generator=g)
    cache = torch.zeros(impl.kv_cache_shape(batch.num_blocks, 16, 2, 64))
    meta = batch.step_metadata(CPU, pad_tokens_to=9)
    extra = torch.ones(4, 2, 64)
    impl.write_kv(torch.cat([batch.key, extra]), torch.cat([batch.value, extra]), cache, meta)
    assert int((cache != 0).any(-1).sum()) == 2 * 5 * 2  # K and V of 5 tokens x 2 kv heads


@needs_ipex
@pytest.mark.parametrize("window, cap", [(4, None), (2, None), (None, 2.0), (100, None),
                                         (4, 2.0), (2, 50.0), (100, 2.0)])
def test_ipex_window_and_soft_cap_match_reference(window: int | None, cap: float | None) -> None:
    """IPEX's window arguments (decode: the window; prefill: window - 1 keys to the left) and its
    soft cap, over prefills, cached context and decodes, against float64; with both (Gemma 2's
    sliding layers) the decodes run torch_decode over IPEX's cache."""
    from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

    kwargs = {k: v for k, v in (("sliding_window", window), ("logits_soft_cap", cap)) if v}
    impl = IpexPagedAttention(8, 64, 2, 0.125, **kwargs)
    assert impl.decode_in_torch == (window is not None and cap is not None)
    specs = [SeqSpec(0, 13), SeqSpec(9, 6), SeqSpec(20, 1), SeqSpec(3, 1)]
    g = torch.Generator().manual_seed(1)
    batch = PagedBatch.random(specs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                              dtype=torch.float32, device=CPU, generator=g)
    cache = torch.zeros(impl.kv_cache_shape(batch.num_blocks, 16, 2, 64))
    batch.write_context(impl, cache, CPU)
    got = batch.run(impl, cache, CPU)
    ref = batch.reference(impl.scale, sliding_window=window, soft_cap=cap)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5), (got.double() - ref).abs().max()


@needs_ipex
@pytest.mark.parametrize("kwargs", [dict(sliding_window=1), dict(sliding_window=1,
                                                                 logits_soft_cap=2.0)])
def test_ipex_refuses_what_its_kernels_cannot_run(kwargs: dict) -> None:
    from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

    with pytest.raises(ValueError, match="attention_backend='torch'"):
        IpexPagedAttention(8, 64, 2, 0.125, **kwargs)


@pytest.fixture(scope="module")
def hf_reference(checkpoint_factory):
    from pagedllm.testing.e2e import hf_greedy, prompts

    cache: dict[str, tuple[str, list[list[int]]]] = {}

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in cache:
            path = checkpoint_factory(arch)
            cache[arch] = (path, hf_greedy(path, prompts(16)))
        return cache[arch]

    return get


@needs_ipex
@pytest.mark.parametrize("mode", [
    dict(),
    dict(enable_prefix_caching=True),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4),
    dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="swap"),
], ids=["plain", "prefix_caching", "chunked_prefill", "preempt_swap"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "qwen3", "mixtral"])
def test_greedy_matches_transformers_with_ipex(hf_reference, arch: str, mode: dict) -> None:
    from pagedllm import LLM
    from pagedllm.testing.e2e import engine_greedy, prompts

    path, expected = hf_reference(arch)
    llm = LLM(path, device="cpu", dtype="float32", attention_backend="ipex", **mode)
    assert llm.llm_engine.executor.worker.attn_cls.name == "ipex"
    assert engine_greedy(llm, prompts(16)) == expected
    if "preemption_mode" in mode:
        assert llm.llm_engine.stats().num_preemptions > 0


@needs_ipex
@pytest.mark.parametrize("mode", [
    dict(), dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                 max_num_batched_tokens=16, max_num_seqs=4),
], ids=["plain", "prefix_caching_chunked_prefill"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_sliding_window_matches_transformers_with_ipex(hf_reference, arch: str,
                                                             mode: dict) -> None:
    """Gemma 3: sliding layers (window 5, shorter than the prompts) between global ones. Gemma
    2: the same with attention soft-capping on every layer, so its sliding layers decode in
    torch over IPEX's cache (IPEX's decode refuses a window with a soft cap)."""
    from pagedllm import LLM
    from pagedllm.testing.e2e import engine_greedy, prompts

    path, expected = hf_reference(arch)
    llm = LLM(path, device="cpu", dtype="float32", attention_backend="ipex", **mode)
    assert llm.llm_engine.executor.worker.attn_cls.name == "ipex"
    assert engine_greedy(llm, prompts(16)) == expected
