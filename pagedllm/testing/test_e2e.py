"""End to end through ``LLM(..., device=NAME)``: greedy output equals Hugging Face transformers'
token for token (float32), in every engine mode the backend declares; seeded sampling repeats."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.e2e import MAX_TOKENS, blocks_needed, engine_greedy, first_mismatch
from pagedllm.testing.invariants import assert_drained

AREA = "end-to-end (HF equality)"
NEEDS_ENGINE = True  # runs an LLM on the device (skipped for kernel-only backends)


def _tight_cache(caps: Capabilities) -> int:
    """Just enough blocks for the longest sequence: the workload must preempt."""
    return blocks_needed(caps.preferred_block_size) + 1


MODES = [
    pytest.param("eager", {}, id="eager"),
    pytest.param("graphs", dict(enforce_eager=False), id="graphs",
                 marks=pytest.mark.capability("graphs")),
    pytest.param("prefix_caching", dict(enable_prefix_caching=True), id="prefix_caching",
                 marks=pytest.mark.capability("prefix_caching")),
    pytest.param("chunked_prefill", dict(enable_chunked_prefill=True, max_num_batched_tokens=16,
                                         max_num_seqs=4),
                 id="chunked_prefill", marks=pytest.mark.capability("chunked_prefill")),
    pytest.param("preempt_recompute", dict(preemption_mode="recompute"), id="preempt_recompute"),
    pytest.param("preempt_swap", dict(preemption_mode="swap"), id="preempt_swap",
                 marks=pytest.mark.capability("swap")),
]


def make_llm(checkpoint: str, device: str, caps: Capabilities, **kwargs: Any) -> Any:
    from pagedllm import LLM

    kwargs.setdefault("enforce_eager", True)
    if kwargs.get("preemption_mode"):
        kwargs["num_gpu_blocks_override"] = _tight_cache(caps)
    return LLM(checkpoint, device=device, dtype="float32", block_size=caps.preferred_block_size,
               max_model_len=512, **kwargs)


@contextlib.contextmanager
def started_llm(checkpoint: str, device: str, caps: Capabilities,
                **kwargs: Any) -> Iterator[Any]:
    """``make_llm`` shut down on exit, pass or fail: an engine sizes its KV cache from the
    device memory left, so the next check's engine needs this one's back (a failed check's
    traceback would otherwise keep it alive for the rest of the session)."""
    llm = make_llm(checkpoint, device, caps, **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.mark.capability("dtype:float32")
@pytest.mark.parametrize("mode,kwargs", MODES)
def test_greedy_matches_transformers(mode: str, kwargs: dict, conformance_checkpoint: str,
                                     conformance_device_name: str, conformance_caps: Capabilities,
                                     conformance_hf_reference: tuple[list, list]) -> None:
    ps, expected = conformance_hf_reference
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps,
                     **kwargs) as llm:
        _greedy_in_mode(llm, mode, ps, expected, conformance_device_name, conformance_caps)


def _greedy_in_mode(llm: Any, mode: str, ps: list, expected: list, device_name: str,
                    conformance_caps: Capabilities) -> None:
    engine = llm.llm_engine
    assert engine.backend.name == device_name
    got = engine_greedy(llm, ps)
    assert got == expected, f"{mode}: {first_mismatch(got, expected)}"
    if mode == "prefix_caching":  # the second pass reads the prompts' KV from the cache
        hits = engine.block_manager.num_prefix_hit_blocks
        got = engine_greedy(llm, ps)
        assert got == expected, f"{mode}, second pass: {first_mismatch(got, expected)}"
        assert engine.block_manager.num_prefix_hit_blocks > hits, "no prefix-cache hits"
    if mode.startswith("preempt"):
        assert engine.stats().num_preemptions > 0, (
            "the workload did not preempt with a cache of "
            f"{_tight_cache(conformance_caps)} blocks, so this mode checked nothing extra")
    assert_drained(engine)


@pytest.mark.capability("dtype:float32")
def test_seeded_sampling_repeats(conformance_checkpoint: str, conformance_device_name: str,
                                 conformance_caps: Capabilities,
                                 conformance_hf_reference: tuple[list, list]) -> None:
    ps = conformance_hf_reference[0][:4]
    with started_llm(conformance_checkpoint, conformance_device_name, conformance_caps) as llm:
        _seeded_repeats(llm, ps)


def _seeded_repeats(llm: Any, ps: list) -> None:
    from pagedllm import SamplingParams

    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                            ignore_eos=True)

    def run() -> list[list[list[int]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    first = run()
    assert all(len(c) == MAX_TOKENS for o in first for c in o)
    assert run() == first, "the same seeded requests gave different tokens"
    assert_drained(llm.llm_engine)
