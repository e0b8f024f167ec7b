"""Checks that hold after any workload drains (used by our tests and the conformance suite)."""
from __future__ import annotations

from typing import Any


def assert_drained(engine: Any) -> None:
    """Every KV block is free or idle-cached, and nothing is kept for finished requests."""
    s = engine.stats()
    assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks, s
    assert (s.num_running, s.num_waiting, s.num_swapped) == (0, 0, 0), s
    assert engine.block_manager.num_tracked_seqs() == 0
    assert not engine._requests
    assert not engine.has_unfinished_requests()
