"""Scheduler policy tests, driven without a model: each step 'samples' token 7 for every
sequence whose scheduled chunk reached its end."""
from __future__ import annotations

import time

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_group(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
               arrival: float | None = None, timeout: float | None = None, n: int = 1) -> SequenceGroup:
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0,
                            timeout_seconds=timeout)
    return SequenceGroup(rid, [Sequence(next(_ids), list(range(1, prompt_len + 1)))], params,
                         arrival_time=arrival if arrival is not None else time.time(),
                         priority=priority,
                         deadline=time.monotonic() + timeout if timeout else None)


def make_sched(blocks: int = 64, block_size: int = 4, max_seqs: int = 8, max_tokens: int = 64,
               chunked: bool = False, mode: str | None = None, host_blocks: int = 0,
               caching: bool = False, max_model_len: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                          enable_chunked_prefill=chunked, preemption_mode=mode)
    cfg.resolve(max_model_len)
    bm = BlockManager(block_size, blocks, host_blocks, watermark=0.0, enable_caching=caching)
    return Scheduler(cfg, bm)


def fake_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.after_step(out)
    for (group, seq), sched in zip(out.entries, out.batch.seqs):
        if sched.num_samples == 0:
            continue
        if not group.forked:
            group.forked = True
            for j in range(1, sched.num_samples):
                child = seq.fork(next(_ids), j)
                s.block_manager.fork(seq, child)
                group.seqs.append(child)
                child.append_token(7, 0.0, None)
        seq.append_token(7, 0.0, None)
        for sq in group.seqs:
            if not sq.is_finished() and sq.num_output_tokens >= group.sampling_params.max_tokens:
                sq.status = SequenceStatus.FINISHED_LENGTH
    s.free_finished()
    return out


def drain(s: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while s.has_unfinished():
        fake_step(s)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def assert_clean(s: Scheduler) -> None:
    bm = s.block_manager
    assert bm.device.num_free + bm.device.num_cached_idle == bm.num_device_blocks
    assert bm.host.num_free == bm.num_host_blocks
    assert bm.num_tracked_seqs() == 0
    assert not (s.waiting or s.running or s.swapped)


def test_continuous_batching_admits_under_budgets() -> None:
    s = make_sched(max_seqs=2)
    for i in range(3):
        s.add(make_group(f"r{i}", 5))
    out = fake_step(s)
    assert [e[0].request_id for e in out.entries] == ["r0", "r1"]  # max_num_seqs=2
    assert len(s.waiting) == 1
    drain(s)
    assert_clean(s)


def test_token_budget_without_chunking_is_head_of_line() -> None:
    s = make_sched(max_tokens=64, max_model_len=64)
    s.add(make_group("a", 40))
    s.add(make_group("b", 40))
    out = fake_step(s)
    assert [e[0].request_id for e in out.entries] == ["a"]
    assert out.batch.num_tokens == 40


def test_chunked_prefill_splits_long_prompt_and_mixes_decodes() -> None:
    s = make_sched(max_tokens=16, chunked=True, max_seqs=4)
    s.add(make_group("short", 3, max_tokens=10))
    fake_step(s)  # short prefilled
    s.add(make_group("long", 40))
    out = fake_step(s)
    tokens = {e[0].request_id: b.num_tokens for e, b in zip(out.entries, out.batch.seqs)}
    assert tokens == {"short": 1, "long": 15}  # decode first, then a 15-token chunk
    assert out.batch.seqs[0].num_tokens == 15  # multi-token chunks come first in the batch
    long_seq = s.running[-1].seqs[0]
    assert long_seq.num_computed_tokens == 15 and long_seq.num_output_tokens == 0
    drain(s)
    assert_clean(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_blocks_run_out(mode: str) -> None:
    s = make_sched(blocks=6, block_size=4, mode=mode, host_blocks=16 if mode == "swap" else 0,
                   max_model_len=32)
    s.add(make_group("old", 8, max_tokens=8, arrival=1.0))
    s.add(make_group("new", 8, max_tokens=8, arrival=2.0))
    drain(s)
    assert s.num_preemptions >= 1
    assert_clean(s)


def test_preempted_victim_is_lowest_priority() -> None:
    s = make_sched(blocks=6, block_size=4, mode="recompute", max_model_len=32)
    s.add(make_group("a", 8, max_tokens=8, arrival=1.0))
    s.add(make_group("b", 8, max_tokens=8, arrival=2.0))
    fake_step(s)
    while s.num_preemptions == 0:
        fake_step(s)
    assert [g.request_id for g in s.waiting] == ["b"]
    assert s.waiting[0].seqs[0].num_computed_tokens == 0


def test_swap_preemption_moves_to_swapped_queue() -> None:
    s = make_sched(blocks=6, block_size=4, mode="swap", host_blocks=16, max_model_len=32)
    s.add(make_group("a", 8, max_tokens=8, arrival=1.0))
    s.add(make_group("b", 8, max_tokens=8, arrival=2.0))
    swapped_seen = False
    while s.has_unfinished():
        out = fake_step(s)
        if out.batch.blocks_to_swap_out:
            swapped_seen = True
            assert [g.request_id for g in s.swapped] == ["b"]
    assert swapped_seen
    assert_clean(s)


def test_priority_order_admission() -> None:
    s = make_sched(max_seqs=1)
    s.add(make_group("low", 4, priority=5, arrival=1.0))
    s.add(make_group("high", 4, priority=0, arrival=2.0))
    out = fake_step(s)
    assert out.entries[0][0].request_id == "high"


def test_waiting_queue_sorted_by_priority_then_arrival_then_order() -> None:
    s = make_sched()
    specs = [(2, 1.0), (0, 3.0), (2, 0.5), (1, 3.0), (0, 3.0), (0, 1.0), (2, 1.0)]
    for i, (priority, arrival) in enumerate(specs):
        s.add(make_group(str(i), 4, priority=priority, arrival=arrival))
    assert [g.request_id for g in s.waiting] == ["5", "1", "4", "3", "2", "0", "6"]


@pytest.mark.parametrize("blocks", [64, 10])
def test_schedule_ahead_admits_waiting_only_with_blocks_to_spare(blocks: int) -> None:
    s = make_sched(blocks=blocks, block_size=4, max_seqs=2, max_tokens=64)
    a = make_group("a", 4, max_tokens=1, arrival=1.0)  # prev's token finishes it
    b = make_group("b", 4, max_tokens=8, arrival=2.0)
    c = make_group("c", 4, max_tokens=4, arrival=3.0)
    for g in (a, b, c):
        s.add(g)
    prev = s.schedule()
    assert [g.request_id for g, _ in prev.entries] == ["a", "b"]
    ahead = s.schedule_ahead(prev)
    if blocks == 10:  # 8 free: fewer than the 63 // 4 + 1 + 1 the budgets could need
        assert ahead is None and [g.request_id for g in s.waiting] == ["c"]
        return
    assert ahead is not None
    assert [(g.request_id, sq.num_tokens) for (g, _), sq in zip(ahead.entries, ahead.batch.seqs)] \
        == [("c", 4), ("b", 1)]
    assert not s.waiting


def test_timeout_finishes_with_partial_output() -> None:
    s = make_sched()
    g = make_group("t", 4, max_tokens=50, timeout=0.05)
    s.add(g)
    fake_step(s)
    fake_step(s)
    time.sleep(0.06)
    out = fake_step(s)
    assert out.timed_out == [g]
    assert g.seqs[0].status == SequenceStatus.FINISHED_TIMEOUT
    assert g.seqs[0].num_output_tokens == 2
    assert_clean(s)


@pytest.mark.parametrize("state", ["waiting", "running", "swapped"])
def test_abort_in_any_state_frees_blocks(state: str) -> None:
    s = make_sched(blocks=6, block_size=4, mode="swap", host_blocks=16, max_model_len=32)
    a = make_group("a", 8, max_tokens=8, arrival=1.0)
    b = make_group("b", 8, max_tokens=8, arrival=2.0)
    s.add(a)
    if state == "waiting":
        target = a
    elif state == "running":
        fake_step(s)
        target = a
    else:
        s.add(b)
        while not s.swapped:
            fake_step(s)
        target = s.swapped[0]
    aborted = s.abort({target.request_id})
    assert aborted == [target]
    assert all(q.status == SequenceStatus.FINISHED_ABORTED for q in target.seqs)
    drain(s)
    assert_clean(s)


def test_n_greater_than_one_forks_and_frees() -> None:
    s = make_sched(block_size=4)
    g = make_group("n", 6, max_tokens=5, n=3)
    s.add(g)
    out = fake_step(s)
    assert out.batch.seqs[0].num_samples == 3
    assert len(g.seqs) == 3
    out = fake_step(s)
    assert out.batch.blocks_to_copy  # the shared partial block is copied on write
    drain(s)
    assert_clean(s)


def test_prefix_caching_skips_cached_tokens() -> None:
    s = make_sched(block_size=4, caching=True)
    s.add(make_group("a", 13, max_tokens=1))
    drain(s)
    s.add(make_group("b", 13, max_tokens=1))
    out = fake_step(s)
    assert out.batch.seqs[0].start_pos == 12 and out.batch.seqs[0].num_tokens == 1
    drain(s)
    assert_clean(s)
