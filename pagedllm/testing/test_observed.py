"""Every declared capability verified by what the engine's backend did (issue 41, item 3), not
only by the output it gave: the checks watch the worker (observe.py) while an engine runs.

- ``chunked_prefill``: prompts reach attention in chunks over their earlier chunks (a prefill
  with context and no prefix cache), and the config still has it on after the backend's
  ``check_and_update_config``;
- ``prefix_caching``: a second pass over the same prompts computes fewer prefill tokens, its
  first chunks starting after cached blocks, and the block manager counted the hits;
- ``swap``: preemption swapped blocks out and back in, and every moved block arrived bit for bit;
- each declared attention feature: a model needing it (a windowed Mistral, Gemma 2's soft caps)
  built its attention with the setting, ran through it, and gave transformers' tokens;
- each declared KV-cache dtype: the worker's caches are of it and attention read them;
- each declared quantization: the backend keeps it in the config, and (``fp8``, which needs no
  special checkpoint) the model's linears hold 1-byte weights and run the op table's
  ``quant_linear``.

All compare greedy tokens with Hugging Face transformers where the feature leaves them exact.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.coverage import note
from pagedllm.testing.e2e import MAX_TOKENS, engine_greedy, first_mismatch, hf_greedy, prompts
from pagedllm.testing.observe import watching
from pagedllm.testing.test_e2e import make_llm

AREA = "claims (observed)"
NEEDS_ENGINE = True  # runs an LLM on the device (skipped for kernel-only backends)
WINDOW = 6  # the windowed Mistral's window: prompts and outputs reach far past it
QUANTIZATIONS = ("awq", "gptq", "compressed-tensors", "fp8")  # Capabilities.quantizations names


def _run(llm: Any, ps: list[list[int]]) -> tuple[list[list[int]], Any]:
    with watching(llm) as obs:
        got = engine_greedy(llm, ps)
    return got, obs


@pytest.mark.capability("dtype:float32", "chunked_prefill")
def test_chunked_prefill_splits(conformance_checkpoint: str, conformance_device_name: str,
                                conformance_caps: Capabilities,
                                conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                   enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert llm.llm_engine.config.scheduler.enable_chunked_prefill, (
            "chunked_prefill=True is declared but the backend's check_and_update_config "
            "turned enable_chunked_prefill off")
        got, obs = _run(llm, ps)
    finally:
        llm.shutdown()
    chunks = [(c, q) for call in obs.attention
              for c, q in zip(call.prefill_context_lens, call.prefill_query_lens) if c > 0]
    assert chunks, ("chunked_prefill=True is declared, prompts are longer than the 16-token "
                    "budget, yet no prefill reached attention over earlier chunks")
    assert all(q <= 16 for _, q in chunks), f"a chunk exceeded the 16-token budget: {chunks}"
    assert got == expected, f"chunked prefill vs transformers: {first_mismatch(got, expected)}"
    note(chunks=len(chunks), chunk_context=sorted({c for c, _ in chunks}))


@pytest.mark.capability("dtype:float32", "prefix_caching")
def test_prefix_caching_hits(conformance_checkpoint: str, conformance_device_name: str,
                             conformance_caps: Capabilities,
                             conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    bs = conformance_caps.preferred_block_size
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                   enable_prefix_caching=True)
    try:
        engine = llm.llm_engine
        assert engine.config.cache.enable_prefix_caching, (
            "prefix_caching=True is declared but the backend's check_and_update_config turned "
            "enable_prefix_caching off")
        first, obs1 = _run(llm, ps)
        hits = engine.block_manager.num_prefix_hit_blocks
        second, obs2 = _run(llm, ps)
        new_hits = engine.block_manager.num_prefix_hit_blocks - hits
    finally:
        llm.shutdown()
    assert first == expected and second == expected, (
        f"prefix caching vs transformers: {first_mismatch(first, expected)} / second pass: "
        f"{first_mismatch(second, expected)}")
    cached = [c for call in obs2.attention for c in call.prefill_context_lens if c >= bs]
    saved = obs1.prefill_tokens() - obs2.prefill_tokens()
    assert new_hits > 0 and cached, (
        f"prefix_caching=True is declared but the second pass over the same prompts hit "
        f"{new_hits} cached blocks and no prefill started after a cached block")
    assert saved >= new_hits * bs, (
        f"the second pass hit {new_hits} cached blocks ({new_hits * bs} tokens) but computed "
        f"only {saved} fewer prefill tokens ({obs1.prefill_tokens()} -> "
        f"{obs2.prefill_tokens()})")
    note(hit_blocks=new_hits, tokens_saved=saved)


@pytest.mark.capability("dtype:float32", "swap")
def test_swap_moves_blocks(conformance_checkpoint: str, conformance_device_name: str,
                           conformance_caps: Capabilities,
                           conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                   preemption_mode="swap")
    try:
        assert llm.llm_engine.config.scheduler.preemption_mode == "swap", (
            "swap=True is declared but the backend's check_and_update_config changed "
            "preemption_mode='swap'")
        got, obs = _run(llm, ps)
    finally:
        llm.shutdown()
    outs = sum(n for d, n in obs.swaps if d == "out")
    ins = sum(n for d, n in obs.swaps if d == "in")
    assert outs > 0 and ins > 0, (
        f"swap=True is declared and the cache was too small for the workload, yet the cache "
        f"ops moved {outs} blocks out and {ins} in")
    assert not obs.swap_mismatches, (
        f"swapped blocks arrived with other bits: {obs.swap_mismatches[:3]}")
    assert got == expected, f"swap preemption vs transformers: {first_mismatch(got, expected)}"
    note(blocks_swapped_out=outs, blocks_swapped_in=ins)


FEATURE_MODELS = {  # feature -> (family, overrides, every feature the model needs)
    "sliding_window": ("mistral", dict(sliding_window=WINDOW), ("sliding_window",)),
    # untied: with Gemma's tied, sqrt(hidden)-scaled embeddings a tiny random model copies its
    # input and attention (the cap with it) never changes a token
    "logits_soft_cap": ("gemma2", dict(head_dim=64, sliding_window=WINDOW,
                                       tie_word_embeddings=False),
                        ("sliding_window", "logits_soft_cap")),
}


@pytest.fixture(scope="module")
def feature_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from pagedllm.testing.e2e import make_conformance_checkpoint

    return {f: make_conformance_checkpoint(str(tmp_path_factory.mktemp(f)), family, **kw)
            for f, (family, kw, _) in FEATURE_MODELS.items()}


@pytest.mark.parametrize("feature", [pytest.param(
    f, marks=pytest.mark.capability("dtype:float32", f"feature:{f}")) for f in FEATURE_MODELS])
def test_attention_feature_is_used(feature: str, feature_checkpoints: dict[str, str],
                                   conformance_device_name: str,
                                   conformance_caps: Capabilities) -> None:
    needs = FEATURE_MODELS[feature][2]
    missing = [f for f in needs if f not in conformance_caps.attention_features]
    if missing:
        pytest.skip(f"the {feature} model also needs {', '.join(missing)}, not declared")
    path = feature_checkpoints[feature]
    ps = prompts(conformance_caps.preferred_block_size)
    expected = hf_greedy(path, ps)
    llm = make_llm(path, conformance_device_name, conformance_caps)
    try:
        got, obs = _run(llm, ps)
    finally:
        llm.shutdown()
    setting = "sliding_window" if feature == "sliding_window" else "logits_soft_cap"
    used = [getattr(c, setting) for c in obs.attention if getattr(c, setting) is not None]
    assert used, (f"{feature} is declared, the model needs it, yet no attention call ran with "
                  f"{setting} set (classes called: {sorted({c.cls for c in obs.attention})})")
    assert got == expected, f"{feature} model vs transformers: {first_mismatch(got, expected)}"
    note(feature=feature, setting=sorted(set(used)), calls=len(obs.attention))


@pytest.mark.parametrize("kv_cache_dtype", [pytest.param(
    "fp8", marks=pytest.mark.capability("dtype:float32", "kv_cache:fp8"))])
def test_kv_cache_dtype_is_used(kv_cache_dtype: str, conformance_checkpoint: str,
                                conformance_device_name: str, conformance_caps: Capabilities,
                                conformance_hf_reference: tuple[list, list]) -> None:
    from pagedllm.testing.harness import KV_CACHE_TORCH_DTYPES

    ps = conformance_hf_reference[0]
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                   kv_cache_dtype=kv_cache_dtype)
    try:
        assert llm.llm_engine.config.cache.cache_dtype == kv_cache_dtype, (
            f"kv_cache_dtypes declares {kv_cache_dtype!r} but check_and_update_config changed it")
        got, obs = _run(llm, ps)
        caches = {c.dtype for c in llm.llm_engine.executor.worker.kv_caches}
    finally:
        llm.shutdown()
    want = KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    assert caches == {want}, f"kv_cache_dtype={kv_cache_dtype!r}: the worker's caches are {caches}"
    read = {c.cache_dtype for c in obs.attention}
    assert read == {want}, f"attention read caches of {read}, not {want}"
    assert all(len(g) == MAX_TOKENS for g in got), "an fp8-cache run stopped early"
    note(kv_cache=kv_cache_dtype, calls=len(obs.attention))


@pytest.mark.parametrize("method", [pytest.param(
    m, marks=pytest.mark.capability(f"quantization:{m}")) for m in QUANTIZATIONS])
def test_quantization_is_kept_and_used(method: str, conformance_backend: Backend,
                                       conformance_checkpoint: str, conformance_device_name: str,
                                       conformance_caps: Capabilities) -> None:
    """The backend keeps a declared method in the config; ``fp8`` (quantized at load, no special
    checkpoint) runs: 1-byte weights, and the op table's quant_linear does the multiplying."""
    from pagedllm.testing.harness import raw_config

    config = raw_config(conformance_backend, dtype=conformance_caps.dtypes[0],
                        block_size=conformance_caps.preferred_block_size)
    config.model.quantization = method
    conformance_backend.check_and_update_config(config)
    assert config.model.quantization == method, (
        f"quantizations declares {method!r} but check_and_update_config changed it to "
        f"{config.model.quantization!r}")
    if method != "fp8":
        return
    ps = prompts(conformance_caps.preferred_block_size)[:4]
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                   quantization="fp8")
    try:
        got, obs = _run(llm, ps)
        model = llm.llm_engine.executor.worker.model
        sizes = {p.element_size() for n, p in model.named_parameters()
                 if n.endswith("proj.weight") or n.endswith("qkv_proj.weight")}
    finally:
        llm.shutdown()
    assert sizes == {1}, f"quantization='fp8': the projections' weights take {sizes} bytes each"
    assert obs.quant_calls > 0, "quantization='fp8' but the op table's quant_linear never ran"
    assert all(len(g) == MAX_TOKENS for g in got), "an fp8-quantized run stopped early"
    note(method=method, quant_calls=obs.quant_calls)
