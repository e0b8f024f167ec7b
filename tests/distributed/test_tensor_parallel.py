"""TP=2 on the cpu (gloo, one worker process per rank) gives TP=1's greedy tokens on every
architecture, with KV heads split and replicated, and with the cache features that move blocks."""
from __future__ import annotations

import gc
import multiprocessing
import types

import pytest

from pagedllm import LLM
from pagedllm.engine.config_validation import check_tensor_parallel
from tp_utils import greedy, wait_until

pytestmark = pytest.mark.timeout(600)

CASES = {
    "llama": ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank
    "qwen2": ("qwen2", {}),  # q/k/v biases, tied embeddings
    "mistral": ("mistral", {}),
    "opt": ("opt", {}),  # column/row-parallel fc1/fc2 with biases, learned positions
    "llama_kv1": ("llama", {"num_key_value_heads": 1}),  # the single KV head is replicated
}
# 3 sequences growing to 2-3 blocks each in a 4-block cache: preemption by swapping
FEATURES = dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=4,
                max_model_len=64, preemption_mode="swap")
FEATURE_TOKENS = 20


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(case: str, checkpoint_factory, tp1_tokens) -> None:
    arch, overrides = CASES[case]
    expected = tp1_tokens(arch, overrides)
    llm = LLM(checkpoint_factory(arch, **overrides), device="cpu", dtype="float32",
              tensor_parallel_size=2)
    workers = [w.process for w in llm.llm_engine.executor.workers]
    try:
        assert llm.llm_engine.config.parallel.distributed_executor_backend == "mp"
        assert greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in workers)


def test_tp2_with_chunked_prefill_prefix_caching_and_swap(checkpoint_factory, tp1_tokens) -> None:
    """Swap-out/in and copy-on-write block moves reach every rank's cache."""
    expected = tp1_tokens("llama", {}, FEATURE_TOKENS, **FEATURES)
    llm = LLM(checkpoint_factory("llama"), device="cpu", dtype="float32", tensor_parallel_size=2,
              **FEATURES)
    workers = [w.process for w in llm.llm_engine.executor.workers]
    assert greedy(llm, max_tokens=FEATURE_TOKENS) == expected
    assert greedy(llm, max_tokens=FEATURE_TOKENS) == expected  # prefix-cache hits
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert llm.llm_engine.block_manager.num_prefix_hit_blocks > 0
    del llm  # garbage collection alone stops the workers
    gc.collect()
    assert wait_until(lambda: not any(p.is_alive() for p in workers), timeout=15)


def test_worker_error_surfaces_with_its_type(checkpoint_factory) -> None:
    """An exception inside the workers (here: an MLP width that cannot be split) reaches the
    caller as the original exception type, naming the rank."""
    path = checkpoint_factory("llama", intermediate_size=129)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=2") as info:
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "worker rank" in notes or "worker rank" in str(info.value)
    assert wait_until(lambda: set(multiprocessing.active_children()) <= before, timeout=15)


def _config(heads: int, kv_heads: int, tp: int, executor: str = "mp") -> types.SimpleNamespace:
    model = types.SimpleNamespace(get_num_heads=lambda: heads, get_num_kv_heads=lambda: kv_heads)
    parallel = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                     distributed_executor_backend=executor)
    return types.SimpleNamespace(model=model, parallel=parallel)


@pytest.mark.parametrize("heads,kv_heads,tp,ok", [
    (4, 2, 2, True), (4, 1, 2, True), (4, 2, 4, True), (8, 8, 4, True),
    (4, 2, 3, False), (6, 3, 2, False), (12, 3, 6, True), (12, 4, 6, False),
])
def test_check_tensor_parallel(heads: int, kv_heads: int, tp: int, ok: bool) -> None:
    backend = types.SimpleNamespace(name="cpu", dist_backend="gloo", device_count=lambda: 1)
    if ok:
        check_tensor_parallel(_config(heads, kv_heads, tp), backend)
    else:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
            check_tensor_parallel(_config(heads, kv_heads, tp), backend)


def test_nccl_needs_a_device_per_rank() -> None:
    backend = types.SimpleNamespace(name="cuda", dist_backend="nccl", device_count=lambda: 1)
    with pytest.raises(ValueError, match="needs 2 cuda devices on this host but 1 are visible"):
        check_tensor_parallel(_config(4, 2, 2), backend)
    check_tensor_parallel(_config(4, 2, 2, executor="ray"), backend)  # Ray: across hosts


def test_bad_tp_size_fails_before_spawning(checkpoint_factory) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        LLM(checkpoint_factory("llama"), device="cpu", dtype="float32", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) <= before
