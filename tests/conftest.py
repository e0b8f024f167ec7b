"""Shared fixtures: tiny random-weight checkpoints built once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint_factory(arch, **config overrides) -> path; cached by arguments."""
    from pagedllm.testing.checkpoints import make_checkpoint

    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides: object) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = make_checkpoint(str(path), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_path(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def cpu_kernels():
    """torch.ops.pagedllm_cpu (csrc/cpu, built on first use); skips where it cannot be built."""
    from pagedllm.backends.cpu.kernels import load_cpu_kernels

    try:
        return load_cpu_kernels()
    except RuntimeError as exc:
        pytest.skip(f"the cpu kernels are unavailable here: {exc}")
