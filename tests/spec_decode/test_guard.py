"""The speculation guard: disable_by_batch_size as vLLM's, and the adaptive default that keeps
the measured faster mode per batch-size bucket while still trying the other now and then."""
from __future__ import annotations

from pagedllm.spec_decode.guard import SpecGuard


def test_disable_by_batch_size() -> None:
    g = SpecGuard(disable_by_batch_size=4)
    assert [g.speculate(b) for b in (1, 3, 4, 9)] == [True, True, False, False]
    assert not g.speculate(0)


def _run(g: SpecGuard, batch: int, spec_rate: float, plain_rate: float, steps: int) -> float:
    """Fraction of ``steps`` that speculated, feeding the guard the given tokens/s."""
    on = 0
    for _ in range(steps):
        s = g.speculate(batch)
        on += s
        g.record(batch, s, 100, 100 / (spec_rate if s else plain_rate))
    return on / steps


def test_adaptive_keeps_the_faster_mode_per_bucket() -> None:
    g = SpecGuard()
    assert _run(g, 1, spec_rate=200, plain_rate=100, steps=320) > 0.95  # batch 1: spec wins
    assert _run(g, 32, spec_rate=60, plain_rate=100, steps=320) < 0.06  # batch 32: plain wins
    # a bucket's decision does not leak into another, and exploring costs at most ~1/32
    assert _run(g, 1, spec_rate=200, plain_rate=100, steps=64) > 0.95


def test_adaptive_follows_a_change() -> None:
    g = SpecGuard()
    _run(g, 8, spec_rate=200, plain_rate=100, steps=200)
    assert _run(g, 8, spec_rate=50, plain_rate=100, steps=400) < 0.2  # drafts stopped matching
