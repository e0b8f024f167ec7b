"""Keeps Python's cyclic garbage collector off the objects that exist before a run.

A full (oldest-generation) collection walks every tracked object: after ``import torch,
transformers`` and an engine's start-up that is ~300k objects and 100-250 ms, paid on whatever
engine step it lands on. Measured on the H200 throughput workload (1000 x 128/128): two decode
steps of ~260 ms each in a 8.5 s run. ``gc.freeze()`` moves the objects alive now into the
permanent generation, which collections skip; objects created during the run are still collected
as usual.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Objects alive on entry are left out of collections until exit (then handed back, so
    whatever became garbage meanwhile is still freed). No-op when the collector is disabled or
    someone else already froze objects: their freeze stays theirs."""
    if not gc.isenabled() or gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_for_process() -> None:
    """For a process that serves until it exits (the engine process of the server): collect
    start-up garbage once, then freeze what remains for good."""
    gc.collect()
    gc.freeze()
