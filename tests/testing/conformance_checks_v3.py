"""The v3 suite's checks (issue 41) as plain calls, for the mutation harness: the swept checks
with the cases a default run takes (space.py's ``pairs`` sweep at the default seed), the
determinism and memory checks, and the engine-level observed claims and repetition."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conformance_checks import Check, registered
from pagedllm.backends.interface import Backend
from pagedllm.testing import (test_cache, test_engine_repeat, test_observed, test_ops_sweep,
                              test_repeat, test_sweep)
from pagedllm.testing.space import DEFAULT_SEED, PAIRS, case_id


def _rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _cases(module: Any, name: str, b: Backend) -> list[dict]:
    caps = b.capabilities
    space = module.SPACES[name](caps, caps.attention_features, caps.kv_cache_dtypes)
    return space.cases(PAIRS, DEFAULT_SEED)


def sweep_checks(b: Backend) -> list[Check]:
    """Every case of the swept checks, then determinism and kernel memory: what a default run
    of test_sweep, test_ops_sweep, test_cache's sweep and test_repeat runs."""
    caps, dev = b.capabilities, torch.device(b.torch_device)
    out: list[Check] = [
        (f"sweep[{case_id(c)}]", lambda c=c: test_sweep.test_attention_sweep(
            b, caps, c, dev, _rng())) for c in _cases(test_sweep, "test_attention_sweep", b)]
    out += [(f"cache_sweep[{case_id(c)}]", lambda c=c: test_cache.test_copy_and_swap_sweep(
        b, caps, c, dev)) for c in _cases(test_cache, "test_copy_and_swap_sweep", b)]
    for name in test_ops_sweep.SPACES:
        fn = getattr(test_ops_sweep, name)
        out += [(f"ops[{name}-{case_id(c)}]", lambda c=c, fn=fn: fn(b, c, dev))
                for c in _cases(test_ops_sweep, name, b)]
    for dt in caps.dtypes:
        out += [(f"deterministic[attention-{dt}]", lambda dt=dt:
                 test_repeat.test_attention_step_twice_is_bitwise_equal(b, caps, dt, dev)),
                (f"deterministic[ops-{dt}]", lambda dt=dt:
                 test_repeat.test_ops_twice_are_bitwise_equal(b, dt, dev))]
    out.append(("memory[kernels]", lambda: test_repeat.test_cache_ops_and_steps_keep_memory_flat(
        b, caps, dev, PAIRS)))
    return out


def engine_checks(b: Backend, checkpoint: str, reference: tuple[list, list],
                  feature_checkpoints: dict[str, str]) -> list[Check]:
    """The observed claims and the engine's repetition check, for what ``b`` declares."""
    caps, dev = b.capabilities, torch.device(b.torch_device)

    def engine(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            with registered(type(b)):
                fn(*args)
        return run

    out: list[Check] = [("engine:memory", engine(
        test_engine_repeat.test_engine_rounds_repeat_and_keep_memory_flat, checkpoint, b.name,
        caps, dev, reference, PAIRS))]
    if caps.chunked_prefill:
        out.append(("engine:chunked_prefill", engine(test_observed.test_chunked_prefill_splits,
                                                     checkpoint, b.name, caps, reference)))
    if caps.prefix_caching:
        out.append(("engine:prefix_caching", engine(test_observed.test_prefix_caching_hits,
                                                    checkpoint, b.name, caps, reference)))
    if caps.swap:
        out.append(("engine:swap", engine(test_observed.test_swap_moves_blocks, checkpoint,
                                          b.name, caps, reference)))
    for feature in caps.attention_features:
        out.append((f"engine:feature[{feature}]", engine(
            test_observed.test_attention_feature_is_used, feature, feature_checkpoints, b.name,
            caps)))
    for kv in caps.kv_cache_dtypes:
        if kv != "auto":
            out.append((f"engine:kv_cache[{kv}]", engine(
                test_observed.test_kv_cache_dtype_is_used, kv, checkpoint, b.name, caps,
                reference)))
    return out
