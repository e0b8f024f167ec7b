"""The offload tiers' bookkeeping, device-free: LRU per tier, demotion host -> disk in the
order the worker must run it, pins, and the idle invariants (which can fail)."""
from __future__ import annotations

import subprocess
import sys

from pagedllm.kv_offload.manager import OffloadingConnector
from pagedllm.kv_offload.tiers import TierIndex
from pagedllm.kv_transfer.base import KVStepOps
from pagedllm.kv_transfer.keys import block_key, root_key


def test_tier_lru_skips_pinned_keys() -> None:
    tier = TierIndex("host", 2)
    assert tier.insert("a") == (0, None) and tier.insert("b") == (1, None)
    tier.touch("a")  # b is now the least recently used
    assert tier.insert("c") == (1, ("b", 1))
    tier.pin("a")
    assert tier.insert("d") == (1, ("c", 1))  # a is older but pinned
    tier.pin("d")
    assert tier.insert("e") is None  # everything pinned: no slot
    assert tier.check_idle() == ["host tier: 2 keys still pinned at idle"]
    tier.unpin("a")
    tier.unpin("d")
    tier.remove("a")
    assert tier.lookup("a") is None and tier.check_idle() == []
    assert tier.insert("f") == (0, None)


def test_eviction_goes_down_the_tiers_in_order() -> None:
    conn = OffloadingConnector(None, {"host": 2, "disk": 3})
    ops = KVStepOps()
    for block, key in enumerate("abc"):
        conn.on_evict(block, key, ops)
    # c took a's host slot: a was demoted to disk *before* c's save overwrote the slot
    assert ops.stores == [("save", "host", 0, 0), ("save", "host", 1, 1),
                          ("move", "host", 0, "disk", 0), ("save", "host", 2, 0)]
    assert conn.locate("a") == ("disk", 0) and conn.locate("c") == ("host", 0)
    ops = KVStepOps()
    conn.on_evict(7, "c", ops)  # already in the host tier: nothing moves
    conn.on_evict(8, "a", ops)  # in disk only: back into host (b demoted), disk keeps it
    assert ops.stores == [("move", "host", 1, "disk", 1), ("save", "host", 8, 1)]
    assert conn.locate("a") == ("host", 1) and conn.locate("b") == ("disk", 1)
    assert conn.check_idle() == []


def test_the_host_tier_writes_computed_blocks_through() -> None:
    """A block entering the device prefix cache is saved into the host tier at once, so its
    eviction later moves nothing; the disk tier is still written on demotion only."""
    conn = OffloadingConnector(None, {"host": 2, "disk": 3})
    ops = KVStepOps()
    conn.on_computed(0, "a", ops)
    conn.on_computed(1, "b", ops)
    conn.on_computed(5, "a", ops)  # resident already (a copy of a loaded block): no save
    assert ops.stores == [("save", "host", 0, 0), ("save", "host", 1, 1)]
    ops = KVStepOps()
    conn.on_evict(0, "a", ops)  # written through: only its LRU place changes (b is older)
    assert ops.stores == []
    conn.on_computed(2, "c", ops)  # b is demoted to disk before c's save takes its slot
    assert ops.stores == [("move", "host", 1, "disk", 0), ("save", "host", 2, 1)]
    assert conn.locate("b") == ("disk", 0) and conn.locate("a") == ("host", 0)
    disk_only = OffloadingConnector(None, {"disk": 2})
    ops = KVStepOps()
    disk_only.on_computed(0, "a", ops)
    assert ops.stores == [] and disk_only.locate("a") is None
    assert conn.check_idle() == [] and disk_only.check_idle() == []


def test_disk_only_saves_straight_to_disk_and_drops_its_lru() -> None:
    conn = OffloadingConnector(None, {"disk": 2})
    ops = KVStepOps()
    for block, key in enumerate("abc"):
        conn.on_evict(block, key, ops)
    assert ops.stores == [("save", "disk", 0, 0), ("save", "disk", 1, 1), ("save", "disk", 2, 0)]
    assert conn.locate("a") is None and conn.stats()["disk"]["evicted"] == 1


def test_keys_are_stable_and_chain_the_prefix() -> None:
    root = root_key("model|float32|auto|16")
    a = block_key(root, [1, 2, 3])
    assert a == block_key(root_key("model|float32|auto|16"), [1, 2, 3])
    assert a != block_key(root_key("model|float32|fp8|16"), [1, 2, 3])
    assert a != block_key(root_key("model|float32|auto|16", lora_int_id=3), [1, 2, 3])
    assert block_key(a, [4]) != block_key(block_key(root, [9, 9, 9]), [4])
    # the same key in another process (Python's hash() is salted there)
    code = ("from pagedllm.kv_transfer.keys import block_key, root_key; "
            "print(block_key(root_key('model|float32|auto|16'), [1, 2, 3]).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a.hex()


def test_scheduler_side_imports_no_torch() -> None:
    code = ("import pagedllm.kv_transfer.scheduler_side, pagedllm.kv_offload.manager, "
            "pagedllm.kv_transfer.shared_storage, pagedllm.core.scheduler; import sys; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
