from __future__ import annotations

import pytest

from pagedllm.core.block_allocator import BlockAllocator
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens)


def group_of(*seqs: Sequence) -> SequenceGroup:
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return SequenceGroup("r", list(seqs), SamplingParams(), arrival_time=0.0)


def test_allocator_free_and_double_free() -> None:
    a = BlockAllocator(3)
    blocks = [a.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate()
    a.free(blocks[0])
    assert a.num_free == 1
    with pytest.raises(RuntimeError, match="double free"):
        a.free(blocks[0])


def test_allocator_hands_out_the_most_recently_freed_block_first() -> None:
    # a freed block's memory is warm and mapped; untouched blocks of the pool come after
    a = BlockAllocator(8)
    first = [a.allocate() for _ in range(4)]
    a.free(first[1])
    a.free(first[3])
    assert a.allocate() == first[3]
    assert a.allocate() == first[1]
    assert a.allocate() not in first


def test_allocate_covers_tokens_and_free_returns_all() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=10)
    s = seq(0, list(range(10)))
    assert bm.can_allocate([(s, 10)])
    bm.allocate(s, 10)
    assert len(bm.block_tables[0]) == 3 and bm.device.num_free == 7
    bm.free(s)
    assert bm.device.num_free == 10 and bm.num_tracked_seqs() == 0


def test_watermark_blocks_admission() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=10, watermark=0.2)  # keep 2 free
    assert bm.can_allocate([(seq(0, list(range(32))), 32)])  # 8 blocks, 2 left
    assert not bm.can_allocate([(seq(1, list(range(33))), 33)])  # 9 blocks, 1 left


def test_append_grows_only_at_block_boundary() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=10)
    s = seq(0, [1, 2, 3, 4])
    bm.allocate(s, 4)
    s.num_computed_tokens = 4
    s.token_ids.append(5)
    assert bm.can_append([(s, 1)])
    assert bm.append_slots(s, 1) == []
    assert len(bm.block_tables[0]) == 2
    s.num_computed_tokens = 5
    s.token_ids.append(6)
    bm.append_slots(s, 1)
    assert len(bm.block_tables[0]) == 2


def test_fork_shares_blocks_and_copy_on_write() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=10)
    parent = seq(0, [1, 2, 3, 4, 5, 6])
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    shared_last = bm.block_tables[0][1]
    assert bm.device.ref_count(shared_last) == 2
    parent.token_ids.append(7)
    copies = bm.append_slots(parent, 1)
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert bm.block_tables[0][1] == copies[0][1] != bm.block_tables[1][1]
    assert bm.device.ref_count(shared_last) == 1
    assert bm.block_tables[0][0] == bm.block_tables[1][0]  # full first block still shared
    child.token_ids.append(8)
    assert bm.append_slots(child, 1) == []  # child now owns the old block alone
    bm.free(parent)
    bm.free(child)
    assert bm.device.num_free == 10


def test_prefix_cache_hits_and_lru_eviction() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=6, watermark=0.0, enable_caching=True)
    a = seq(0, list(range(9)))  # 2 full blocks + 1
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    first_two = bm.block_tables[0][:2]
    bm.free(a)
    assert bm.device.num_cached_idle == 2 and bm.device.num_free == 4

    b = seq(1, list(range(8)) + [100, 101])  # same two leading blocks
    assert bm.num_prefix_hit_tokens(b) == 8
    bm.allocate(b, 2)
    assert b.num_computed_tokens == 8 and bm.block_tables[1][:2] == first_two
    assert bm.device.num_cached_idle == 0

    # a prompt that is entirely cached still recomputes its last token
    c = seq(2, list(range(8)))
    assert bm.num_prefix_hit_tokens(c) == 4
    bm.free(b)

    # LRU: fill the pool with new content; the tail of the old chain goes first
    d = seq(3, [50 + i for i in range(16)])
    bm.allocate(d, 16)  # 4 fresh blocks from the free list, none evicted yet
    assert bm.device.num_evictions == 0
    e = seq(4, [90, 91, 92, 93])
    bm.allocate(e, 4)  # evicts one cached block: the chain's tail (freed first)
    assert bm.device.num_evictions == 1
    assert bm.num_prefix_hit_tokens(seq(5, list(range(9)))) == 4


def test_swap_out_and_in_roundtrip_shared_blocks() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8, num_host_blocks=8, watermark=0.0)
    parent = seq(0, list(range(6)))
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    g = group_of(parent, child)
    assert bm.can_swap_out(g)
    pairs = bm.swap_out(g)
    assert len(pairs) == 2  # shared blocks are copied once
    assert bm.device.num_free == 8 and bm.host.num_free == 6
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(g)
    back = bm.swap_in(g)
    assert len(back) == 2 and bm.host.num_free == 8
    assert bm.block_tables[0] == bm.block_tables[1]
    bm.free(parent)
    bm.free(child)
    assert bm.device.num_free == 8 and bm.num_tracked_seqs() == 0


def test_swap_in_refused_without_room() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=4, num_host_blocks=8, watermark=0.0)
    s = seq(0, list(range(12)))
    bm.allocate(s, 12)
    g = group_of(s)
    bm.swap_out(g)
    s.status = SequenceStatus.SWAPPED
    other = seq(1, list(range(8)))
    bm.allocate(other, 8)
    assert not bm.can_swap_in(g)  # needs 3 blocks + 1 spare, 2 free
