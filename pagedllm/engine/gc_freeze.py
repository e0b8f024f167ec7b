"""Keeps Python's cyclic garbage collector from pausing an offline run.

A full (oldest-generation) collection walks every tracked object: after ``import torch,
transformers`` and an engine's start-up that is ~460k objects and 200-300 ms, paid on whatever
engine step it lands on (the H200 throughput workload, 1000 x 128/128: one or two decode steps
of 250-360 ms in an 8.5 s run). During a run, automatic full collections are held off until it
ends (the young collections, which free the run's short-lived cycles, go on), and the objects
alive at its start are frozen (``gc.freeze()``) so that an explicit ``gc.collect()`` skips them
-- unless a freeze exists already: the H200 machine's interpreter freezes a few hundred objects
at start-up, and the unfreeze at the end would hand back theirs too. The hold delays no garbage of
the engine's own: a request leaves no reference cycles behind (tests/engine/test_gc_freeze.py).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# the generation-2 threshold during a run: a full collection waits for more generation-1
# collections than any run makes
_NEVER = 2**30


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """No automatic full collection before exit, and the objects alive on entry are left out of
    the collections that do run (handed back at exit, so whatever became garbage meanwhile is
    still freed). No-op when the collector is disabled. Where someone already froze objects
    (some environments freeze at interpreter start-up), their freeze is left as it is and only
    the full collections are held off: an unfreeze at exit would hand back theirs too."""
    if not gc.isenabled():
        yield
        return
    thresholds = gc.get_threshold()
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if ours:
            gc.unfreeze()


def freeze_for_process() -> None:
    """For a process that serves until it exits (the engine process of the server): collect
    start-up garbage once, then freeze what remains for good."""
    gc.collect()
    gc.freeze()
