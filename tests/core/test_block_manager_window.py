"""Blocks that slid out of the sliding window freed early (BlockManager(sliding_window=...)):
what every query still to come (or still in flight) can see stays; the rest goes back to the
pool, through decode, fork + copy-on-write, swap, recompute and prefix caching."""
from __future__ import annotations

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

BS = 4


def group_of(*seqs: Sequence) -> SequenceGroup:
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return SequenceGroup("r", list(seqs), SamplingParams(), arrival_time=0.0)


def decode(bm: BlockManager, s: Sequence, steps: int) -> list[int]:
    """``steps`` engine steps of one decoded token each; returns the live block count after each
    step's append_slots, checking that every position the step's query (and the previous step's,
    which may still be in flight) can see is in a live, unchanged block."""
    live = []
    for _ in range(steps):
        s.token_ids.append(7)
        table_before = list(bm.block_tables[s.seq_id])
        q_prev = s.num_computed_tokens - 1  # the previous step's query
        bm.append_slots(s, 1)
        table = bm.block_tables[s.seq_id]
        dropped = bm._dropped.get(s.seq_id, 0)
        first_seen = max(0, q_prev - bm.sliding_window + 1)  # positions > q_prev - window
        assert first_seen // BS >= dropped, "a visible position lost its block"
        assert table[dropped:len(table_before)] == table_before[dropped:]
        assert set(table[:dropped]) <= {table[dropped]}  # placeholders repeat a live block
        live.append(len(table) - dropped)
        s.num_computed_tokens += 1
    return live


def test_decode_keeps_only_the_window_live() -> None:
    bm = BlockManager(BS, num_device_blocks=64, watermark=0.0, sliding_window=6)
    s = Sequence(0, list(range(10)))
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    live = decode(bm, s, 60)
    # window 6 over blocks of 4 plus one step of lag: never more than 4 live blocks
    assert max(live[5:]) <= 4 and bm.num_slid_out_blocks == len(bm.block_tables[0]) - live[-1]
    assert bm.device.num_free == 64 - live[-1]
    bm.free(s)
    assert bm.device.num_free == 64 and bm.num_tracked_seqs() == 0


def test_without_a_window_nothing_is_freed_early() -> None:
    bm = BlockManager(BS, num_device_blocks=64, watermark=0.0)
    s = Sequence(0, list(range(10)))
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    for _ in range(30):
        s.token_ids.append(7)
        bm.append_slots(s, 1)
        s.num_computed_tokens += 1
    assert bm.num_slid_out_blocks == 0 and bm.device.num_free == 64 - len(bm.block_tables[0])


def test_fork_copy_on_write_and_free_with_dropped_blocks() -> None:
    bm = BlockManager(BS, num_device_blocks=32, watermark=0.0, sliding_window=3)
    parent = Sequence(0, list(range(9)))
    bm.allocate(parent, 9)
    parent.num_computed_tokens = 9
    decode(bm, parent, 10)
    assert bm._dropped[0] > 0
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    for s in (parent, child):
        s.token_ids.append(8)
        bm.append_slots(s, 1)  # the last block is shared: one of them copies it
    assert bm.block_tables[0][-1] != bm.block_tables[1][-1]
    bm.free(parent)
    bm.free(child)
    assert bm.device.num_free == 32 and bm.num_tracked_seqs() == 0


def test_swap_out_and_in_moves_only_live_blocks() -> None:
    bm = BlockManager(BS, num_device_blocks=32, num_host_blocks=32, watermark=0.0,
                      sliding_window=5)
    s = Sequence(0, list(range(6)))
    bm.allocate(s, 6)
    s.num_computed_tokens = 6
    decode(bm, s, 30)
    dropped, live = bm._dropped[0], len(bm.block_tables[0]) - bm._dropped[0]
    g = group_of(s)
    assert bm.can_swap_out(g)
    assert len(bm.swap_out(g)) == live
    assert bm.device.num_free == 32 and bm.host.num_free == 32 - live
    s.status = SequenceStatus.SWAPPED
    assert len(bm.swap_in(g)) == live and bm.host.num_free == 32
    table = bm.block_tables[0]
    assert len(table) == dropped + live and set(table[:dropped]) == {table[dropped]}
    s.status = SequenceStatus.RUNNING
    decode(bm, s, 8)  # keeps sliding after the round trip
    bm.free(s)
    assert bm.device.num_free == 32 and bm.host.num_free == 32 and bm.num_tracked_seqs() == 0


def test_prefix_cache_keeps_slid_out_blocks_for_other_prompts() -> None:
    bm = BlockManager(BS, num_device_blocks=32, watermark=0.0, enable_caching=True,
                      sliding_window=4)
    prompt = list(range(100, 120))
    s = Sequence(0, list(prompt))
    bm.allocate(s, 20)
    s.num_computed_tokens = 20
    bm.cache_full_blocks(s)
    decode(bm, s, 12)
    bm.cache_full_blocks(s)
    assert bm._dropped[0] >= 4
    # freed early but still cached: a new request with the same prompt hits all of it
    again = Sequence(1, list(prompt) + [1])
    assert bm.num_prefix_hit_tokens(again) == 20
    bm.free(s)
    bm.free(again)  # drops the keys the lookup computed
    assert bm.device.num_available == 32 and bm.num_tracked_seqs() == 0


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(BS, num_device_blocks=4, sliding_window=0)
