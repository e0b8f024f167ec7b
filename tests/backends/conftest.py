"""Fixtures shared by the backend tests."""
from __future__ import annotations

import pytest

from pagedllm.backends.cpu import ops as cpu_ops


@pytest.fixture
def route(monkeypatch: pytest.MonkeyPatch):
    """route(fp32=None|"mkl"|"onednn", half=None|"native"|"float32"): sets the cpu linear routes
    (backends/cpu/ops.py) with fresh cached choices, restored after the test. A test parametrized
    over a "route" argument of its own (test_cpu_ops.py) does not get this fixture."""
    def set_routes(fp32: str | None = None, half: str | None = None) -> None:
        for env, value in ((cpu_ops.FP32_LINEAR_ENV, fp32), (cpu_ops.HALF_LINEAR_ENV, half)):
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
        cpu_ops.fp32_linear_route.cache_clear()
        cpu_ops.half_compute_dtype.cache_clear()

    yield set_routes
    monkeypatch.undo()
    cpu_ops.fp32_linear_route.cache_clear()
    cpu_ops.half_compute_dtype.cache_clear()
