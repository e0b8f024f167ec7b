"""The tpu backend. Without torch_xla (the main environment): bucketing, the per-token layout,
the gather attention against the float64 reference, availability reasons, lazy imports. With
torch_xla and XLA on the host CPU (the tpu CI leg: PJRT_DEVICE=CPU PAGEDLLM_TPU_ALLOW_CPU=1):
the XLA behaviour the backend relies on, the gather path against torch_xla's own ragged
paged-attention reference, greedy equality with Hugging Face for four architectures, and that a
varied workload compiles nothing after the warm-up."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.tpu.attention import XlaPagedAttention, gather_attention
from pagedllm.backends.tpu.backend import TpuBackend
from pagedllm.backends.tpu.buckets import BucketGrid, next_power_of_two, powers_of_two
from pagedllm.backends.tpu.layout import SeqRows, ragged_layout, token_layout
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

CPU = torch.device("cpu")
XLA_READY = TpuBackend.availability()[0]
needs_xla = pytest.mark.skipif(not XLA_READY, reason="needs torch_xla with a TPU, or "
                               "PJRT_DEVICE=CPU PAGEDLLM_TPU_ALLOW_CPU=1 (the tpu CI leg)")


# --- buckets ---------------------------------------------------------------------------------
def test_powers_of_two() -> None:
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 17, 64)] == [1, 1, 2, 4, 32, 64]
    assert powers_of_two(16, 100) == [16, 32, 64, 128]


def test_every_step_within_the_limits_lands_in_the_grid() -> None:
    grid = BucketGrid.from_limits(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256,
                                  block_size=16)
    assert grid.token_buckets == (16, 32, 64, 128, 256)
    assert grid.row_buckets == (8,)
    assert grid.width_buckets == (8, 16)
    assert grid.num_programs == 5 * 2 + 5 * 2  # heads: 8 rows, or all rows (prompt logprobs)
    models, heads = set(grid.model_shapes()), set(grid.head_shapes())
    for tokens in range(1, 257):
        for rows in {*range(0, min(tokens, 8) + 1), tokens // 2, tokens}:
            for width in range(1, 17):
                s = grid.shape_for(tokens, rows, width)
                assert s.tokens >= tokens and s.rows >= rows and s.width >= width
                assert (s.tokens, s.width) in models and (s.tokens, s.rows) in heads


def test_one_width_when_not_bucketed() -> None:
    grid = BucketGrid.from_limits(2048, 256, 2048, 16, bucket_width=False)
    assert grid.width_buckets == (128,)
    assert len(grid.model_shapes()) == len(grid.token_buckets)


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        BucketGrid.from_limits(16, 0, 16, 16)


# --- layout and attention on plain torch tensors ---------------------------------------------
def test_token_and_ragged_layout() -> None:
    rows = SeqRows(q_lens=[3, 1], seq_lens=[3, 18], tables=[[4], [7, 2]])
    tables, pos = token_layout(rows, num_rows=6, width=4, block_size=16)
    assert pos.tolist() == [0, 1, 2, 17, 0, 0]
    assert tables.tolist() == [[4, 0, 0, 0]] * 3 + [[7, 2, 0, 0]] + [[0, 0, 0, 0]] * 2
    ragged = ragged_layout(rows, num_seqs=4, width=2, block_size=16)
    assert ragged["kv_lens"].tolist() == [3, 18, 0, 0]
    assert ragged["cu_q_lens"].tolist() == [0, 3, 4, 4, 4]
    assert ragged["page_indices"].tolist() == [[4, 0], [7, 2], [0, 0], [0, 0]]
    assert ragged["num_seqs"].tolist() == [2]
    with pytest.raises(ValueError, match="width 1"):
        token_layout(rows, num_rows=6, width=1, block_size=16)


def _run(impl: XlaPagedAttention, specs: list[SeqSpec], block_size: int, device: torch.device,
         pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch.random(specs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                              head_size=impl.head_size, block_size=block_size,
                              dtype=torch.float32, device=device, generator=g)
    shape = impl.kv_cache_shape(batch.num_blocks, block_size, impl.num_kv_heads, impl.head_size)
    cache = (torch.randn(shape, generator=g) + 40.0).to(device)  # stale values, not zeros
    batch.write_context(impl, cache, device)
    t = batch.query.shape[0]
    out = batch.run(impl, cache, device, pad_tokens_to=t + pad_rows if pad_rows else 0)
    return out[:t].cpu(), batch.reference(impl.scale)


MIXED = [SeqSpec(16, 3), SeqSpec(35, 18), SeqSpec(5, 9), SeqSpec(0, 6), SeqSpec(16, 1),
         SeqSpec(3, 1), SeqSpec(0, 1)]


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
def test_gather_attention_matches_reference_on_cpu(heads: tuple[int, int]) -> None:
    impl = XlaPagedAttention(heads[0], 64, heads[1], 64 ** -0.5)
    got, ref = _run(impl, MIXED, 16, CPU, pad_rows=5)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, cap", [(4, None), (1, 2.0), (None, 1.5), (20, 3.0)])
def test_gather_attention_window_and_soft_cap_on_cpu(window: int | None, cap: float | None) -> None:
    """Windows shorter than the prompts and the cached context, with pad rows, vs float64."""
    kwargs = {k: v for k, v in (("sliding_window", window), ("logits_soft_cap", cap)) if v}
    impl = XlaPagedAttention(8, 64, 2, 64 ** -0.5, **kwargs)
    g = torch.Generator().manual_seed(5)
    batch = PagedBatch.random(MIXED, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                              dtype=torch.float32, device=CPU, generator=g)
    cache = torch.randn(impl.kv_cache_shape(batch.num_blocks, 16, 2, 64), generator=g) + 40.0
    batch.write_context(impl, cache, CPU)
    t = batch.query.shape[0]
    got = batch.run(impl, cache, CPU, pad_tokens_to=t + 5)[:t]
    ref = batch.reference(impl.scale, sliding_window=window, soft_cap=cap)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_pad_rows_write_nothing_on_cpu() -> None:
    impl = XlaPagedAttention(4, 64, 2, 0.125)
    cache = torch.zeros(impl.kv_cache_shape(4, 16, 2, 64))
    g = torch.Generator().manual_seed(1)
    batch = PagedBatch.random([SeqSpec(0, 5)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, device=CPU, generator=g)
    meta = batch.step_metadata(CPU, pad_tokens_to=8)
    key = torch.cat([batch.key, torch.ones(3, 2, 64)])
    impl.write_kv(key, key, cache, meta)
    assert int((cache != 0).any(-1).sum()) == 5 * 4  # 5 tokens x (K, V) x 2 kv heads
    k = cache[0].view(-1, 4, 64)[:, 0::2]  # K of kv head h sits at 2h
    assert torch.equal(k[batch.block_tables[0][0] * 16:][:5], batch.key)


def test_gather_attention_sees_only_its_prefix() -> None:
    pages = torch.zeros(2, 4, 2, 8)  # 2 blocks of 4, one kv head (K at 0, V at 1), D=8
    pages[0, :, 1] = torch.arange(4.0)[:, None]  # V = position
    q = torch.zeros(3, 1, 8)  # uniform scores: the output is the mean visible V
    out = gather_attention(q, pages, torch.zeros(3, 1, dtype=torch.int32),
                           torch.tensor([0, 1, 3], dtype=torch.int32), 1.0)
    assert out[:, 0, 0].tolist() == [0.0, 0.5, 1.5]


# --- backend ---------------------------------------------------------------------------------
def _python(code: str, **env: str) -> str:
    full = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=full, check=True)
    return out.stdout.strip()


def test_availability_explains_itself() -> None:
    code = ("from pagedllm.backends.tpu.backend import TpuBackend as B; "
            "ok, why = B.availability(); print(ok, why)")
    out = _python(code, PJRT_DEVICE="CPU", PAGEDLLM_TPU_ALLOW_CPU="0")
    assert out.startswith("False")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        assert "torch_xla is not installed" in out and "pip install torch-xla" in out
    else:  # XLA on the host is opt-in, so --device auto never picks it
        assert "PAGEDLLM_TPU_ALLOW_CPU=1" in out


def test_importing_the_backend_imports_no_torch_xla() -> None:
    code = ("import sys, pagedllm.backends.tpu.backend, pagedllm.backends.tpu.buckets; "
            "print('torch_xla' in sys.modules)")
    assert _python(code) == "False"


def test_no_swap_is_declared_and_enforced() -> None:
    from pagedllm.backends.tpu.cache_ops import XlaCacheOps
    from pagedllm.testing.harness import raw_config

    backend = TpuBackend()
    assert not backend.capabilities.swap and backend.capabilities.static_shapes
    config = raw_config(backend, dtype="float32", block_size=16)
    backend.check_and_update_config(config)
    assert config.cache.swap_space_gib == 0.0
    from pagedllm.engine.config_validation import check_backend

    swapping = raw_config(backend, dtype="float32", block_size=16, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode='swap' is not supported by the tpu"):
        backend.check_and_update_config(swapping)
        check_backend(swapping, backend)
    with pytest.raises(NotImplementedError, match="recompute"):
        XlaCacheOps().swap_blocks([], [], torch.tensor([[0, 1]]))


# --- XLA (PJRT CPU in CI, or a TPU) ----------------------------------------------------------
@pytest.fixture(scope="module")
def xla() -> torch.device:
    import torch_xla

    return torch_xla.device()


@needs_xla
def test_xla_scatter_drops_out_of_range_rows(xla: torch.device) -> None:
    """write_kv sends pad rows out of range; XLA's index_copy must drop them."""
    cache = torch.zeros(8, 3, device=xla)
    src = (torch.arange(12.0).view(4, 3) + 1).to(xla)
    cache.index_copy_(0, torch.tensor([2, 8, 5, 100]).to(xla), src)
    expected = torch.zeros(8, 3)
    expected[2], expected[5] = torch.tensor([1.0, 2, 3]), torch.tensor([7.0, 8, 9])
    assert torch.equal(cache.cpu(), expected)


@needs_xla
def test_copy_blocks_pads_the_pair_count(xla: torch.device) -> None:
    from pagedllm.backends.tpu.cache_ops import XlaCacheOps

    caches = [torch.randn(1, 6, 2, 4, 8) for _ in range(2)]
    pairs = torch.tensor([[1, 2], [4, 0], [3, 5]])  # 3 pairs run as a program for 4
    expected = [c.clone() for c in caches]
    for c in expected:
        c[:, pairs[:, 1]] = c[:, pairs[:, 0]]
    on_xla = [c.to(xla) for c in caches]
    XlaCacheOps().copy_blocks(on_xla, pairs.to(xla))
    assert all(torch.equal(c.cpu(), e) for c, e in zip(on_xla, expected))


@needs_xla
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_gather_matches_torch_xla_ragged_reference(xla: torch.device,
                                                   heads: tuple[int, int]) -> None:
    """The static-shape gather against torch_xla's ragged_paged_attention(use_kernel=False),
    the per-sequence reference of the Pallas kernel that runs on a TPU."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    impl = XlaPagedAttention(heads[0], 64, heads[1], 64 ** -0.5)
    g = torch.Generator().manual_seed(3)
    batch = PagedBatch.random(MIXED, num_heads=heads[0], num_kv_heads=heads[1], head_size=64,
                              block_size=16, dtype=torch.float32, device=xla, generator=g)
    cache = torch.randn(impl.kv_cache_shape(batch.num_blocks, 16, heads[1], 64),
                        generator=g).to(xla)
    batch.write_context(impl, cache, xla)
    meta = batch.step_metadata(xla)
    t = batch.query.shape[0]
    ours = impl.forward(batch.query.reshape(t, -1), batch.key.reshape(t, -1),
                        batch.value.reshape(t, -1), cache, meta).view(t, heads[0], 64).cpu()
    rows = SeqRows.from_metadata(meta, batch.block_tables)
    ragged = {k: v.to(xla) for k, v in ragged_layout(rows, len(MIXED), 4, 16).items()}
    theirs = ragged_paged_attention(batch.query, cache[0], ragged["kv_lens"],
                                    ragged["page_indices"], ragged["cu_q_lens"],
                                    ragged["num_seqs"], sm_scale=impl.scale, use_kernel=False)
    assert (ours - theirs.cpu()[:t]).abs().max().item() < 1e-5
    assert torch.allclose(ours.double(), batch.reference(impl.scale), atol=1e-5, rtol=1e-5)


@needs_xla
def test_gather_window_and_soft_cap_match_torch_xla_ragged_reference(xla: torch.device) -> None:
    """Sliding window and soft cap: ours on XLA vs ragged_paged_attention(use_kernel=False)
    given the same sliding_window / soft_cap (what the Pallas kernel gets on a TPU)."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    impl = XlaPagedAttention(8, 64, 2, 64 ** -0.5, sliding_window=7, logits_soft_cap=2.0)
    g = torch.Generator().manual_seed(4)
    batch = PagedBatch.random(MIXED, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                              dtype=torch.float32, device=xla, generator=g)
    cache = torch.randn(impl.kv_cache_shape(batch.num_blocks, 16, 2, 64), generator=g).to(xla)
    batch.write_context(impl, cache, xla)
    meta = batch.step_metadata(xla)
    t = batch.query.shape[0]
    ours = impl.forward(batch.query.reshape(t, -1), batch.key.reshape(t, -1),
                        batch.value.reshape(t, -1), cache, meta).view(t, 8, 64).cpu()
    rows = SeqRows.from_metadata(meta, batch.block_tables)
    ragged = {k: v.to(xla) for k, v in ragged_layout(rows, len(MIXED), 4, 16).items()}
    theirs = ragged_paged_attention(batch.query, cache[0], ragged["kv_lens"],
                                    ragged["page_indices"], ragged["cu_q_lens"],
                                    ragged["num_seqs"], sm_scale=impl.scale, sliding_window=7,
                                    soft_cap=2.0, use_kernel=False)
    assert (ours - theirs.cpu()[:t]).abs().max().item() < 1e-5


HF_MODES = {
    "plain": dict(),
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16,
                            max_num_seqs=4),
    "preempt_recompute": dict(num_gpu_blocks_override=12, preemption_mode="recompute"),
}


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    base = [rng.randint(3, 258) for _ in range(40)]
    mixed = [[rng.randint(3, 258) for _ in range(n)] for n in (5, 17, 33, 2, 64)]
    return mixed + [base, base[:32] + [7, 8, 9]]


@pytest.fixture(scope="module")
def hf_reference(checkpoint_factory):
    from pagedllm.testing.e2e import hf_greedy

    cache: dict[str, tuple[str, list[list[int]]]] = {}

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in cache:
            path = checkpoint_factory(arch)
            cache[arch] = (path, hf_greedy(path, _prompts()))
        return cache[arch]

    return get


@needs_xla
@pytest.mark.parametrize("mode", list(HF_MODES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "opt", "gemma2", "qwen3", "mixtral"])
def test_greedy_matches_transformers_on_xla(arch: str, mode: str, hf_reference) -> None:
    from pagedllm import LLM
    from pagedllm.testing.e2e import engine_greedy

    path, expected = hf_reference(arch)
    kwargs = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)
    kwargs.update(HF_MODES[mode])
    llm = LLM(path, device="tpu", dtype="float32", **kwargs)
    assert engine_greedy(llm, _prompts()) == expected
    engine = llm.llm_engine
    if mode == "prefix_caching":
        hits = engine.block_manager.num_prefix_hit_blocks
        assert engine_greedy(llm, _prompts()) == expected
        assert engine.block_manager.num_prefix_hit_blocks > hits
    if mode == "preempt_recompute":
        assert engine.stats().num_preemptions > 0


@needs_xla
def test_varied_workload_compiles_nothing_after_warm_up(hf_reference) -> None:
    """Warm-up compiles every program of the bucket grid; then prompts of many lengths, batch
    sizes that shrink step by step, prefix-cache hits, forked samples (copy-on-write) and
    prompt logprobs within the row buckets compile nothing new."""
    import torch_xla.debug.metrics as met

    from pagedllm import LLM, SamplingParams

    def compiles() -> int:
        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    path, _ = hf_reference("llama")
    before = compiles()
    llm = LLM(path, device="tpu", dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=128, enable_prefix_caching=True)
    worker = llm.llm_engine.executor.worker
    grid = worker.runner.grid
    after_warm_up = compiles()
    # + weights and zeroed caches materialized once, + one copy program per pair-count bucket
    budget = grid.num_programs + 2 + len(worker.copy_buckets)
    assert after_warm_up - before <= budget, (after_warm_up - before, grid.describe())
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": p[:20 + i]} for i, p in enumerate(prompts[:4])],
                 SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, prompt_logprobs=1),
                 use_tqdm=False)
    for n in (17, 40):  # single fresh prompts (no prefix hits): 32- and 64-token buckets
        llm.generate({"prompt_token_ids": [(11 * j + n) % 250 + 3 for j in range(n)]},
                     SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert compiles() == after_warm_up, "a step compiled a program the warm-up did not"
    shapes = worker.runner.shapes_run
    assert len({s.tokens for s in shapes}) >= 4 and any(s.rows > 8 for s in shapes), shapes
