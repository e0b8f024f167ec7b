"""The conformance suite checks itself: a clean reference plugin passes every check, and each of
the realistic single bugs in conformance_mutants.py, applied alone, fails at least one.

A mutant runs its likely checks first and stops at the first failure, so the whole harness
takes seconds for the kernel-level bugs; the two engine-level claims (graphs, async_output)
build one small checkpoint and its transformers reference once.
"""
from __future__ import annotations

import os

import pytest
from conformance_checks import claim_checks, first_failure, kernel_checks, run_all
from conformance_mutants import MUTANTS, Mutant
from conformance_refplugin import RefBackend

LISTED_IN_ISSUE = {"gqa_power_of_two", "head_size_tiles_of_64", "bug_only_at_block_size_64",
                   "graphs_declared_not_implemented", "async_output_declared_not_implemented",
                   "bf16_cache_through_fp16", "scale_ignored"}


@pytest.fixture(scope="module")
def claim_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, tuple[list, list]]:
    """A tiny random Llama checkpoint and its transformers greedy outputs (claims only)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pagedllm.testing.e2e import hf_greedy, make_conformance_checkpoint, prompts

    path = make_conformance_checkpoint(str(tmp_path_factory.mktemp("mutation-llama")))
    ps = prompts(RefBackend.capabilities.preferred_block_size)[:3]
    return path, (ps, hf_greedy(path, ps))


def test_the_harness_is_big_enough() -> None:
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names) >= 25
    assert LISTED_IN_ISSUE <= set(names)


def test_reference_plugin_passes_every_check() -> None:
    """Without this, a mutant 'caught' could be the suite failing a correct plugin."""
    checks = kernel_checks(RefBackend())
    assert len(checks) > 60
    assert run_all(checks) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_suite_catches_the_mutant(mutant: Mutant, request: pytest.FixtureRequest) -> None:
    backend = mutant.backend()
    checks = kernel_checks(backend)
    if backend.capabilities.graphs or backend.capabilities.async_output:
        checkpoint, reference = request.getfixturevalue("claim_inputs")
        checks = claim_checks(backend, checkpoint, reference) + checks
    caught = first_failure(checks, mutant.first)
    assert caught is not None, f"no conformance check fails for the bug: {mutant.bug}"
