"""LLM.generate keeps the collector off the objects alive before the run, and only during it."""
from __future__ import annotations

import gc
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.gc_freeze import frozen_gc


@pytest.fixture
def clean_gc():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_during_generate_and_handed_back_after(llm: LLM, clean_gc) -> None:
    seen: list[int] = []
    engine = llm.llm_engine
    plain_step = engine.step

    def step():  # noqa: ANN202 - records the freeze count while the run steps
        seen.append(gc.get_freeze_count())
        return plain_step()

    engine.step = step  # type: ignore[method-assign]
    try:
        out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        del engine.step
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and min(seen) > 0, "objects alive before the run were not frozen during it"
    assert gc.get_freeze_count() == 0, "the freeze outlived the run"


def test_garbage_from_before_the_run_is_still_collected_after(clean_gc) -> None:
    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    ref = weakref.ref(a)
    with frozen_gc():
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: skipped by collections during the run
    gc.collect()
    assert ref() is None  # handed back at exit, so freed by the next collection


def test_an_existing_freeze_is_left_alone(clean_gc) -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_gc():
        pass
    assert gc.get_freeze_count() == before > 0


def test_disabled_collector_is_left_disabled(clean_gc) -> None:
    gc.disable()
    try:
        with frozen_gc():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
