"""Fixtures for the tensor-parallel tests."""
from __future__ import annotations

import pytest
from tp_utils import MAX_TOKENS, greedy

from pagedllm import LLM


@pytest.fixture(scope="session")
def tp1_tokens(checkpoint_factory):
    """Greedy tokens of the single-process engine, cached per (arch, overrides, engine kwargs)."""
    cache: dict[tuple, list[list[int]]] = {}

    def get(arch: str, overrides: dict, max_tokens: int = MAX_TOKENS,
            **engine_kwargs: object) -> list[list[int]]:
        key = (arch, tuple(sorted(overrides.items())), max_tokens,
               tuple(sorted(engine_kwargs.items())))
        if key not in cache:
            llm = LLM(checkpoint_factory(arch, **overrides), device="cpu", dtype="float32",
                      **engine_kwargs)
            cache[key] = greedy(llm, max_tokens=max_tokens)
            llm.llm_engine.shutdown()
        return cache[key]

    return get
