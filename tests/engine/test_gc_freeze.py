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
    seen: list[tuple[int, int]] = []
    engine = llm.llm_engine
    plain_step = engine.step
    thresholds = gc.get_threshold()

    def step():  # noqa: ANN202 - records the freeze count and full-collection threshold
        seen.append((gc.get_freeze_count(), gc.get_threshold()[2]))
        return plain_step()

    engine.step = step  # type: ignore[method-assign]
    try:
        out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        del engine.step
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and min(f for f, _ in seen) > 0, "objects alive before the run were not frozen"
    assert min(t for _, t in seen) > 10**6, "full collections could run mid-run"
    assert gc.get_freeze_count() == 0, "the freeze outlived the run"
    assert gc.get_threshold() == thresholds, "the collector's thresholds were not restored"


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


def test_the_collector_still_frees_the_runs_cycles_on_its_own(clean_gc) -> None:
    class Node:
        other: object = None

    with frozen_gc():
        refs = []
        for _ in range(100):
            a, b = Node(), Node()
            a.other, b.other = b, a
            refs.append(weakref.ref(a))
        del a, b
        churn = [[i] for i in range(20 * gc.get_threshold()[0])]  # allocations trigger collections
        del churn
        assert sum(r() is None for r in refs) == len(refs)


def test_an_existing_freeze_is_left_alone_and_full_collections_still_held(clean_gc) -> None:
    gc.freeze()
    before, thresholds = gc.get_freeze_count(), gc.get_threshold()
    with frozen_gc():
        assert gc.get_freeze_count() == before
        assert gc.get_threshold()[2] > 10**6
    assert gc.get_freeze_count() == before > 0
    assert gc.get_threshold() == thresholds


def test_disabled_collector_is_left_disabled(clean_gc) -> None:
    gc.disable()
    try:
        with frozen_gc():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_requests_leave_no_cyclic_garbage(llm: LLM, clean_gc) -> None:
    """What makes holding full collections off for a whole run safe: the engine frees each
    request by reference counting, so the held-off collections would find nothing of it."""
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
              SamplingParams(n=2, seed=3, max_tokens=5, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=6, stop=["a"], prompt_logprobs=1, temperature=0.0)]
    prompts = [{"prompt_token_ids": [5 + i, 17, 33]} for i in range(24)]
    run_params = [params[i % 3] for i in range(len(prompts))]
    llm.generate(prompts[:3], run_params[:3], use_tqdm=False)  # first-use caches are not garbage
    gc.collect()
    gc.disable()
    try:
        outs = llm.generate(prompts, run_params, use_tqdm=False)
        assert len(outs) == len(prompts)
        del outs
        assert gc.collect() == 0
    finally:
        gc.enable()
