"""The one-launch batch-1 decode step's switches (pagedllm/backends/cuda/decode_step.py); the step
itself is tested on the GPU in tests/kernels/test_decode_step.py."""
from __future__ import annotations

import pytest

from pagedllm.backends.cuda import decode_step


def test_step_is_opt_in(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDLLM_DECODE_STEP", raising=False)
    assert not decode_step.enabled()
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "1")
    assert decode_step.enabled()


@pytest.mark.parametrize("value", ["1", "7", "x", ""])
def test_ring_slots_outside_2_to_6_name_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP_SLOTS", value)
    with pytest.raises(ValueError, match=r"PAGEDLLM_DECODE_STEP_SLOTS=.*\[2, 6\]"):
        decode_step.ring_slots()


def test_ring_slots_default(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDLLM_DECODE_STEP_SLOTS", raising=False)
    assert decode_step.ring_slots() == 5
