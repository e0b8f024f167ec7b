"""The conformance suite checks itself: a clean reference plugin passes every check, and each of
the realistic single bugs in conformance_mutants.py and conformance_mutants_v3.py, applied
alone, fails at least one.

A mutant runs its likely checks first and stops at the first failure, so the whole harness
takes seconds for the kernel-level bugs; the engine-level ones (claims, the engine's memory)
build small checkpoints and their transformers references once per module.
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
from conformance_checks import claim_checks, first_failure, kernel_checks, run_all
from conformance_checks_v3 import engine_checks, sweep_checks
from conformance_mutants import MUTANTS, Mutant
from conformance_mutants_v3 import BLIND_SPOTS, NEW_MUTANTS
from conformance_refplugin import RefBackend

pytestmark = pytest.mark.timeout(1800)

LISTED_IN_ISSUE = {"gqa_power_of_two", "head_size_tiles_of_64", "bug_only_at_block_size_64",
                   "graphs_declared_not_implemented", "async_output_declared_not_implemented",
                   "bf16_cache_through_fp16", "scale_ignored"}
ALL = MUTANTS + NEW_MUTANTS


@pytest.fixture(scope="module")
def claim_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, tuple[list, list]]:
    """A tiny random Llama checkpoint and its transformers greedy outputs (claims only)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pagedllm.testing.e2e import hf_greedy, make_conformance_checkpoint, prompts

    path = make_conformance_checkpoint(str(tmp_path_factory.mktemp("mutation-llama")))
    ps = prompts(RefBackend.capabilities.preferred_block_size)
    return path, (ps, hf_greedy(path, ps))


@pytest.fixture(scope="module")
def feature_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from pagedllm.testing.e2e import make_conformance_checkpoint
    from pagedllm.testing.test_observed import FEATURE_MODELS

    return {f: make_conformance_checkpoint(str(tmp_path_factory.mktemp(f)), family, **kw)
            for f, (family, kw, _) in FEATURE_MODELS.items()}


def test_the_harness_is_big_enough() -> None:
    names = [m.name for m in ALL]
    assert len(set(names)) == len(names) >= 50
    assert LISTED_IN_ISSUE <= set(names)
    per_class = Counter(m.blind_spot for m in NEW_MUTANTS)
    assert all(per_class[c] >= 2 for c in BLIND_SPOTS), per_class


def test_reference_plugin_passes_every_check() -> None:
    """Without this, a mutant 'caught' could be the suite failing a correct plugin."""
    checks = kernel_checks(RefBackend()) + sweep_checks(RefBackend())
    assert len(checks) > 200
    assert run_all(checks) == []


def test_reference_plugin_passes_the_engine_checks(claim_inputs: tuple, feature_checkpoints: dict
                                                   ) -> None:
    checkpoint, reference = claim_inputs
    checks = engine_checks(RefBackend(), checkpoint, reference, feature_checkpoints)
    assert len(checks) >= 6
    assert run_all(checks) == []


@pytest.mark.parametrize("mutant", ALL, ids=[m.name for m in ALL])
def test_the_suite_catches_the_mutant(mutant: Mutant, request: pytest.FixtureRequest) -> None:
    backend = mutant.backend()
    checks = kernel_checks(backend) + sweep_checks(backend)
    if backend.capabilities.graphs or backend.capabilities.async_output:
        checkpoint, reference = request.getfixturevalue("claim_inputs")
        checks = claim_checks(backend, checkpoint, reference) + checks
    if mutant.engine:
        checkpoint, reference = request.getfixturevalue("claim_inputs")
        checks = engine_checks(backend, checkpoint, reference,
                               request.getfixturevalue("feature_checkpoints")) + checks
    caught = first_failure(checks, mutant.first)
    assert caught is not None, f"no conformance check fails for the bug: {mutant.bug}"
