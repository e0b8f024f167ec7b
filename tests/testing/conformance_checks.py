"""The conformance suite's checks as plain calls, for the mutation harness.

``suite_checks(backend)`` lists (name, call) for every check the pytest suite would run on
this backend — the same test functions of ``pagedllm.testing``, with what the plugin's fixtures
would pass, and only for what the backend declares (the plugin's NOT DECLARED rule). Running
them in-process lets the harness stop at a mutant's first failure instead of paying a pytest
session per mutant.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedllm.backends.interface import Backend, BackendInfo
from pagedllm.testing import test_attention, test_cache, test_claims, test_limits
from pagedllm.testing.harness import block_sizes_to_test
from pagedllm.testing.sweep import CUSTOM_SCALES, gqa_groups

Check = tuple[str, Callable[[], None]]


def _rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def kernel_checks(b: Backend) -> list[Check]:
    """Attention, cache and limit checks (no model, no engine): seconds in all."""
    caps, dev = b.capabilities, torch.device(b.torch_device)
    out: list[Check] = []
    for dt in caps.dtypes:
        out += [(f"reordered[{dt}]", lambda dt=dt: test_limits.test_reordered_batch(
            b, caps, dt, dev))]
        out += [(f"block_size[{dt}-bs{bs}]", lambda dt=dt, bs=bs: test_limits.test_every_block_size(
            b, caps, dt, bs, dev, _rng())) for bs in sorted(caps.block_sizes)]
        out += [(f"head_size[{dt}-hs{hs}]", lambda dt=dt, hs=hs: test_limits.test_head_size(
            b, caps, dt, hs, dev, _rng())) for hs in sorted(caps.head_sizes)]
        out += [(f"gqa[{dt}-g{g}]", lambda dt=dt, g=g: test_limits.test_gqa_group(
            b, caps, dt, g, dev, _rng())) for g in gqa_groups(caps)
            if caps.max_gqa_group is None or g <= caps.max_gqa_group]
        out += [(f"scale[{dt}-{s}]", lambda dt=dt, s=s: test_limits.test_custom_scale(
            b, caps, dt, s, dev, _rng())) for s in CUSTOM_SCALES]
        out += [(f"dtype_edges[{dt}]", lambda dt=dt: test_limits.test_dtype_edges(
            b, caps, dt, dev, _rng()))]
        out += [(f"long_context[{dt}]", lambda dt=dt: test_limits.test_long_context(
            b, caps, dt, dev, _rng()))]
        if "sliding_window" in caps.attention_features:
            out += [(f"sliding_window[{dt}-{w}]", lambda dt=dt, w=w: test_limits.test_sliding_window(
                b, caps, dt, w, dev, _rng())) for w in (2, 7, 40)]
        if "logits_soft_cap" in caps.attention_features:
            out += [(f"soft_cap[{dt}-{c}]", lambda dt=dt, c=c: test_limits.test_logits_soft_cap(
                b, caps, dt, c, dev, _rng())) for c in (5.0, 30.0)]
        for bs in block_sizes_to_test(caps.block_sizes, caps.preferred_block_size):
            out += [(f"write_kv[{dt}-bs{bs}]", lambda dt=dt, bs=bs:
                     test_cache.test_write_kv_fills_exactly_the_mapped_slots(b, dt, bs, dev,
                                                                              _rng())),
                    (f"copy_blocks[{dt}-bs{bs}]", lambda dt=dt, bs=bs:
                     test_cache.test_copy_blocks(b, dt, bs, dev, _rng()))]
            if caps.swap:
                out += [(f"swap[{dt}-bs{bs}]", lambda dt=dt, bs=bs:
                         test_cache.test_swap_out_and_in(b, dt, bs, dev, _rng()))]
        out += [(f"pad_rows[{dt}]", lambda dt=dt: test_attention.test_pad_rows_change_nothing(
            b, caps, dt, dev))]
    return out


@contextlib.contextmanager
def registered(backend_cls: type[Backend]) -> Iterator[None]:
    """``backend_cls`` known to the registry under its name (the engine resolves it by name
    through ``pagedllm.contract.registry``; the old path re-exports it)."""
    from pagedllm.backends import registry as old_path
    from pagedllm.contract import registry

    original = registry.discover

    def discover() -> dict[str, BackendInfo]:
        infos = original()
        infos[backend_cls.name] = BackendInfo(backend_cls.name, "mutation-harness", backend_cls)
        return infos

    registry.discover = old_path.discover = discover
    try:
        yield
    finally:
        registry.discover = old_path.discover = original


def claim_checks(b: Backend, checkpoint: str, reference: tuple[list, list]) -> list[Check]:
    """The engine-level claim checks (graphs, async_output) the backend declares."""
    caps = b.capabilities
    out: list[Check] = []

    def engine_check(fn: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            with registered(type(b)):
                fn(checkpoint, b.name, caps, reference)
        return run

    if caps.graphs:
        out.append(("claims:graphs", engine_check(test_claims.test_graphs_are_captured_and_replayed)))
    if caps.async_output:
        out.append(("claims:async_output",
                    engine_check(test_claims.test_async_output_returns_before_the_device_finishes)))
    return out


def first_failure(checks: list[Check], first: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """Runs the checks whose names start with one of ``first`` before the others; stops at the
    first failure and returns (check name, message), or None when every check passed."""
    ordered = ([c for c in checks if c[0].startswith(first)] if first else []) + \
              [c for c in checks if not (first and c[0].startswith(first))]
    for name, call in ordered:
        try:
            call()
        except Exception as exc:  # an AssertionError, or the plugin crashing on the input
            return name, f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def run_all(checks: list[Check]) -> list[tuple[str, Any]]:
    """Every check's outcome (for the clean plugin: all must pass)."""
    failures = []
    for name, call in checks:
        try:
            call()
        except Exception as exc:
            failures.append((name, f"{type(exc).__name__}: {str(exc)[:300]}"))
    return failures
