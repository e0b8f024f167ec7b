"""Repetition at the engine level (issue 41, item 2): the same requests run again on the same
engine give the same tokens and bitwise-equal logprobs (``deterministic``), and after a warm-up
the engine's memory stays flat over more rounds of them: no more live tensors, no device
allocator growth, host RSS within a few MiB."""
from __future__ import annotations

import struct
from typing import Any

import pytest

from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.coverage import note
from pagedllm.testing.e2e import MAX_TOKENS
from pagedllm.testing.invariants import assert_drained
from pagedllm.testing.resources import Snapshot, assert_flat
from pagedllm.testing.test_e2e import make_llm

AREA = "determinism and resources"
NEEDS_ENGINE = True  # runs an LLM on the device (skipped for kernel-only backends)
CAPABILITY_OF = {"test_engine_rounds_repeat_and_keep_memory_flat": "memory flat (engine)"}
ROUNDS = 3  # rounds of the workload between two memory snapshots


def _round(llm: Any, ps: list[list[int]]) -> list[tuple[list[int], list[bytes]]]:
    """Greedy tokens and each token's logprob as its float's bytes."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [struct.pack("<d", float(step[tok])) for tok, step in zip(c.token_ids,
                                                                         c.logprobs or [])]
        result.append((list(c.token_ids), lps))
    return result


@pytest.mark.capability("dtype:float32")
def test_engine_rounds_repeat_and_keep_memory_flat(conformance_checkpoint: str,
                                                   conformance_device_name: str,
                                                   conformance_caps: Capabilities,
                                                   conformance_device: Any,
                                                   conformance_hf_reference: tuple[list, list],
                                                   conformance_sweep_mode: str) -> None:
    """A sampled run (the ``values`` sweep) takes one round between snapshots, not three."""
    from pagedllm.testing.plugin import has_capability

    n = 1 if conformance_sweep_mode == "values" else ROUNDS
    ps = conformance_hf_reference[0]
    llm = make_llm(conformance_checkpoint, conformance_device_name, conformance_caps)
    try:
        warm = [_round(llm, ps) for _ in range(2)]
        first = Snapshot.take(conformance_device)
        rounds = [_round(llm, ps) for _ in range(n)]
        middle = Snapshot.take(conformance_device)
        rounds += [_round(llm, ps) for _ in range(n)]
        last = Snapshot.take(conformance_device)
        assert_drained(llm.llm_engine)
    finally:
        llm.shutdown()
    if has_capability(conformance_caps, "deterministic"):
        for i, r in enumerate(warm[1:] + rounds):
            for p, (a, b) in enumerate(zip(warm[0], r)):
                assert a[0] == b[0], f"round {i + 2}, prompt {p}: tokens differ from round 1"
                assert a[1] == b[1], (f"round {i + 2}, prompt {p}: logprobs differ from round 1 "
                                      "in their bits (declare deterministic=False if the "
                                      "backend cannot promise it)")
    assert_flat(first, middle, f"{n} rounds of {len(ps)} requests after a warm-up",
                rss_slack=64 << 20)
    growth = assert_flat(middle, last, f"{n} more rounds", rss_slack=32 << 20)
    note(rounds=2 + 2 * n, requests_per_round=len(ps),
         rss_growth_mib=round(growth["rss_bytes"] / (1 << 20), 1))
