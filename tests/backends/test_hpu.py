"""The hpu backend's device-independent parts, on the CPU: bucketing, the flattened block list,
flat decode and padded prefill attention against the float64 reference, pad-row cache writes,
and the whole hpu worker path emulated on the host (habana calls do nothing on a CPU device),
end to end against Hugging Face. Nothing here needs habana_frameworks."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

from pagedllm.backends.hpu.attention import HpuPagedAttention
from pagedllm.backends.hpu.backend import HpuBackend
from pagedllm.backends.hpu.buckets import BucketRange, HpuBuckets
from pagedllm.backends.hpu.flat_attention import flat_blocks, flat_decode_attention
from pagedllm.backends.hpu.model_runner import HpuModelRunner
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

CPU = torch.device("cpu")


# --- bucketing -------------------------------------------------------------------------------
@pytest.mark.parametrize("rng,expected", [
    ((1, 32, 256), [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]),
    ((128, 128, 512), [128, 256, 384, 512]),
    ((1, 8, 5), [1, 2, 4, 8]),
    ((1, 128, 1), [1]),
])
def test_bucket_range_ramps_then_steps(rng: tuple[int, int, int], expected: list[int]) -> None:
    assert BucketRange(*rng).values() == expected


def test_bucket_picks_the_smallest_cover() -> None:
    r = BucketRange(1, 32, 256)
    assert [r.bucket(n) for n in (1, 3, 17, 33, 256, 257)] == [1, 4, 32, 64, 256, 288]
    with pytest.raises(ValueError, match="min <= max"):
        BucketRange(8, 4, 2)


def test_warmup_shapes_cover_every_step_the_limits_allow() -> None:
    b = HpuBuckets.from_limits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                               block_size=128)
    prefill = set(b.prefill_shapes(512))
    decode = set(b.decode_shapes(4))
    for batch in range(1, 9):
        for length in range(1, 513):
            if batch * length <= 512:
                assert b.prefill_shape(batch, length) in prefill, (batch, length)
        for blocks in range(batch, 4 * batch + 1):
            assert b.decode_shape(batch, blocks) in decode, (batch, blocks)


# --- HPU graph counters (the conformance suite's graphs claim reads them) -----------------------
class _ShapeOnlyModel(torch.nn.Module):
    """Stands in for the model: the counters depend only on the padded input shapes."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                metadata: object) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 4)  # [rows, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], 8)  # [rows, vocab]


def _runner(counters: Counter | None) -> HpuModelRunner:
    buckets = HpuBuckets.from_limits(max_num_seqs=4, max_num_batched_tokens=256,
                                     max_model_len=256, block_size=128)
    return HpuModelRunner(_ShapeOnlyModel(), 128, CPU, 0, buckets, graph_counters=counters)


def test_graph_counters_capture_each_bucket_once_then_replay() -> None:
    counters: Counter = Counter()
    runner = _runner(counters)
    buckets, _ = runner.warm_up([], 256, 2)
    assert buckets > 2 and counters == Counter(graph_captures=buckets)
    runner.warm_up([], 256, 2)  # every shape again: all replays, no new capture
    assert counters == Counter(graph_captures=buckets, graph_replays=buckets)
    # a step whose padded shape was warmed up replays; the count follows the sub-steps run
    step = next(iter(runner.shapes_run))
    runner.forward(runner.dummy_input(step), [])
    assert counters["graph_replays"] == buckets + 1 and counters["graph_captures"] == buckets


def test_eager_runner_counts_no_graphs() -> None:
    runner = _runner(None)
    runner.warm_up([], 256, 2)
    assert runner.shapes_run and runner.graph_counters is None


# --- flat block list -------------------------------------------------------------------------
def test_flat_blocks_layout() -> None:
    flat = flat_blocks([1, 17, 32], [[7], [3, 5], [2, 9, 4]], block_size=16, num_blocks=8,
                       batch=4)
    assert flat.block_list.tolist() == [7, 3, 5, 2, 9, 0, 0, 0]
    assert flat.block_groups.tolist() == [0, 1, 1, 2, 2, 4, 4, 4]  # pads -> dummy group 4
    assert flat.block_usage.tolist() == [1, 16, 1, 16, 16, 1, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        flat_blocks([40], [[1, 2, 3]], block_size=16, num_blocks=2)


def _impl(num_heads: int, num_kv_heads: int, head_size: int) -> HpuPagedAttention:
    return HpuPagedAttention(num_heads, head_size, num_kv_heads, head_size ** -0.5)


def _batch(specs: list[SeqSpec], impl: HpuPagedAttention, block_size: int,
           dtype: torch.dtype = torch.float32) -> tuple[PagedBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch.random(specs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                              head_size=impl.head_size, block_size=block_size, dtype=dtype,
                              device=CPU, generator=g)
    shape = impl.kv_cache_shape(batch.num_blocks, block_size, impl.num_kv_heads, impl.head_size)
    cache = (torch.randn(shape, generator=g) + 40.0).to(dtype)  # stale values, not zeros
    batch.write_context(impl, cache, CPU)
    return batch, cache


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_flat_decode_matches_reference(heads: tuple[int, int], block_size: int) -> None:
    impl = _impl(heads[0], heads[1], 64)
    seq_lens = [1, block_size, block_size + 1, 2 * block_size + 5, 3 * block_size - 1]
    batch, cache = _batch([SeqSpec(n - 1, 1) for n in seq_lens], impl, block_size)
    ref = batch.reference(impl.scale)
    got = batch.run(impl, cache, CPU)  # packed metadata: the template split
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)
    # the runner's layout: batch padded to 8 rows, flat list padded to 32 blocks
    meta = batch.step_metadata(CPU, pad_tokens_to=8)
    flat = flat_blocks(seq_lens, batch.block_tables, block_size, num_blocks=32, batch=8)
    q = torch.cat([batch.query, batch.query[:3]])
    out = flat_decode_attention(q, cache[0], cache[1], flat, impl.scale)
    assert torch.allclose(out[:5].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[5:], torch.zeros_like(out[5:])), "rows without blocks must be 0"
    meta.extras = {"hpu": "decode", "flat": flat}
    k = torch.cat([batch.key, batch.key[:3]])
    v = torch.cat([batch.value, batch.value[:3]])
    fwd = impl.forward(q.reshape(8, -1), k.reshape(8, -1), v.reshape(8, -1), cache, meta)
    assert torch.allclose(fwd.view(8, heads[0], 64)[:5].double(), ref, atol=1e-5, rtol=1e-5)


def test_padded_prefill_matches_reference() -> None:
    impl = _impl(8, 2, 64)
    specs = [SeqSpec(0, n) for n in (17, 2, 33, 1)]
    batch, cache = _batch(specs, impl, 16)
    ref = batch.reference(impl.scale)
    got = batch.run(impl, cache, CPU, pad_tokens_to=60)[:53]
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_prefill_over_cached_context_is_refused() -> None:
    impl = _impl(4, 2, 64)
    batch, cache = _batch([SeqSpec(16, 4)], impl, 16)
    with pytest.raises(NotImplementedError, match="cached context"):
        batch.run(impl, cache, CPU)


def test_pad_rows_write_nothing() -> None:
    """Pad rows (slot -1) repeat row 0's write, so the cache changes exactly as without them."""
    impl = _impl(4, 2, 64)
    batch, _ = _batch([SeqSpec(0, 5), SeqSpec(3, 1)], impl, 16)
    shape = impl.kv_cache_shape(batch.num_blocks, 16, 2, 64)
    plain, padded = torch.zeros(shape), torch.zeros(shape)
    impl.write_kv(batch.key, batch.value, plain, batch.step_metadata(CPU))
    meta = batch.step_metadata(CPU, pad_tokens_to=9)
    junk = torch.full((3, 2, 64), 7.0)
    impl.write_kv(torch.cat([batch.key, junk]), torch.cat([batch.value, junk]), padded, meta)
    assert torch.equal(plain, padded)


# --- backend ---------------------------------------------------------------------------------
def test_unavailable_without_habana_says_why() -> None:
    ok, reason = HpuBackend.availability()
    if ok:
        pytest.skip("a Gaudi device is present")
    assert "habana_frameworks" in reason or "Gaudi" in reason


def test_importing_the_backend_imports_no_sdk() -> None:
    code = ("import sys, pagedllm.backends.hpu.backend, pagedllm.backends.hpu.worker; "
            "print(any(m.startswith('habana_frameworks') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_block_size_defaults_to_128() -> None:
    from pagedllm.testing.harness import raw_config

    backend = HpuBackend()
    config = raw_config(backend, dtype="float32", block_size=16)
    backend.check_and_update_config(config)
    assert config.cache.block_size == 128
    from pagedllm.engine.config_validation import check_backend

    other = raw_config(backend, dtype="float32", block_size=32)
    with pytest.raises(ValueError, match="block_size=32 is not supported by the hpu backend"):
        backend.check_and_update_config(other)
        check_backend(other, backend)


@pytest.fixture
def emulated_hpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hpu backend on the host: torch device cpu, available; habana calls become no-ops."""
    monkeypatch.setattr(HpuBackend, "torch_device", "cpu")
    monkeypatch.setattr(HpuBackend, "availability",
                        classmethod(lambda cls: (True, "emulated on the host CPU")))


PROMPT_LENS = (5, 120, 33, 2, 125, 17)  # 120 and 125 cross a 128-token block while decoding


@pytest.fixture(scope="module")
def hf_reference(checkpoint_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    from pagedllm.testing.e2e import hf_greedy

    path = checkpoint_factory("llama")
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    return path, prompts, hf_greedy(path, prompts)


@pytest.mark.parametrize("mode", [
    dict(enforce_eager=False),
    dict(num_gpu_blocks_override=3, max_model_len=256, preemption_mode="recompute"),
    dict(num_gpu_blocks_override=3, max_model_len=256, preemption_mode="swap"),
], ids=["graphs", "preempt_recompute", "preempt_swap"])
def test_emulated_hpu_engine_matches_transformers(emulated_hpu: None, hf_reference: tuple,
                                                  mode: dict) -> None:
    from pagedllm import LLM, SamplingParams

    path, prompts, expected = hf_reference
    kwargs = dict(enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=512)
    kwargs.update(mode)
    llm = LLM(path, device="hpu", dtype="float32", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = llm.llm_engine
    assert engine.config.cache.block_size == 128
    runner = engine.executor.worker.runner
    assert {s.kind for s in runner.shapes_run} == {"prefill", "decode"}
    assert all(s.batch in runner.buckets.decode_bs.values() for s in runner.shapes_run
               if s.kind == "decode")
    if "preemption_mode" in mode:
        assert engine.stats().num_preemptions > 0
    # HPU graphs are recorded only on a Gaudi: on the CPU stand-in none is claimed
    counters = engine.executor.worker.counters
    assert counters["graph_captures"] == 0 and counters["graph_replays"] == 0
