"""The worker side of the offload tiers moving bytes: runs of consecutive host slots go to and
from the device directly (no staging copy), the rest through staging, and a direct save never
overtakes a queued job that still reads or writes its slots."""
from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.backends.cpu.cache_ops import CpuCacheOps
from pagedllm.kv_offload.stores import DiskStore, HostPool
from pagedllm.kv_transfer.base import KVStepOps
from pagedllm.kv_transfer.worker_side import CacheLayout, KVConnectorWorker, KVWorkerRunner

NUM_LAYERS, NUM_BLOCKS = 3, 32


def make_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g, dtype=torch.float32)
            for _ in range(NUM_LAYERS)]


def block_bytes(caches: list[torch.Tensor], block: int) -> list[bytes]:
    return [c.select(1, block).contiguous().view(torch.uint8).numpy().tobytes() for c in caches]


class GatedPool(HostPool):
    """A host pool whose writes wait for ``gate``: keeps the I/O thread busy on demand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def write(self, slots, rows) -> None:
        self.gate.wait(10)
        super().write(slots, rows)


def make_runner(tmp_path, caches: list[torch.Tensor],
                layer_major: bool = False) -> tuple[KVWorkerRunner, CacheLayout]:
    ops = CpuCacheOps()
    layout = CacheLayout(num_layers=NUM_LAYERS, block_nbytes=ops.block_nbytes(caches[0]),
                         layer_major=layer_major)
    part = KVConnectorWorker(None, {}, layout)
    part.stores = {"host": HostPool("host", 24, layout),
                   "slow": GatedPool("slow", 4, layout),
                   "disk": DiskStore("disk", 24, layout, str(tmp_path))}
    return KVWorkerRunner(ops, layout, [part]), layout


@pytest.mark.parametrize("layer_major", [False, True], ids=["slot-major", "layer-major"])
def test_runs_move_directly_and_scattered_slots_through_staging(tmp_path, layer_major) -> None:
    """Either host pool layout (layer-major: Capabilities.kv_export_layer_major), queued loads
    and loads ready before the step alike."""
    caches = make_caches(0)
    runner, _ = make_runner(tmp_path, caches, layer_major)
    # blocks 0..7 into host slots 4..11 (a run: direct), blocks 8, 9 into slots 20, 14, blocks
    # 10..14 into slots 19..15 (a run downwards: direct, as a sequence evicted last block first)
    saves = ([("save", "host", b, 4 + b) for b in range(8)]
             + [("save", "host", 8, 20), ("save", "host", 9, 14)]
             + [("save", "host", 10 + i, 19 - i) for i in range(5)])
    expected = {b: block_bytes(caches, b) for b in range(15)}
    runner.before_moves(KVStepOps(stores=saves), caches)
    runner.flush()
    pool = runner.stores["host"]
    view = pool.view(4, 8)  # a view of the pool: no copy
    assert view.untyped_storage().data_ptr() == pool.pool.untyped_storage().data_ptr()
    assert view.is_contiguous() != layer_major
    assert all(view[:, layer].is_contiguous() for layer in range(NUM_LAYERS)) == layer_major
    slot19 = pool.view(19, 1)[0].contiguous().numpy().tobytes()
    assert slot19 == b"".join(expected[10])  # slot 19: block 10
    # load them back into blocks 16.. (direct run 4..11, scattered 20, 14, downward 19..15)
    loads = ([("host", 4 + b, 16 + b) for b in range(8)] + [("host", 20, 24), ("host", 14, 25)]
             + [("host", 19 - i, 26 + i) for i in range(5)])
    runner.after_moves(KVStepOps(loads=loads), caches)
    failed, seconds = runner.take_load_results()
    assert failed == [] and len(seconds) == 1
    for b in range(8):
        assert block_bytes(caches, 16 + b) == expected[b]
    assert block_bytes(caches, 24) == expected[8] and block_bytes(caches, 25) == expected[9]
    for i in range(5):
        assert block_bytes(caches, 26 + i) == expected[10 + i]
    assert runner.counters["loaded_blocks:host"] == 15
    # the same slots again as loads ready before the step (the host tier's same-step hits)
    runner.after_moves(KVStepOps(ready_loads=[(st, sl, b + 1) for st, sl, b in loads]), caches)
    runner.before_moves(None, caches)  # the next step fences them in full
    for b in range(8):
        assert block_bytes(caches, 17 + b) == expected[b]
    assert block_bytes(caches, 27 + 4) == expected[14]
    runner.close()


def test_a_direct_save_waits_for_queued_jobs_on_its_slots(tmp_path) -> None:
    caches = make_caches(1)
    runner, _ = make_runner(tmp_path, caches)
    old = {b: block_bytes(caches, b) for b in range(6)}
    runner.before_moves(KVStepOps(stores=[("save", "host", b, b) for b in range(6)]), caches)
    runner.flush()
    slow = runner.stores["slow"]
    # the I/O thread is held by a write into the gated pool; behind it, a demotion reads host
    # slots 0..5 to disk; then a direct save overwrites those host slots with other blocks
    step = KVStepOps(stores=[("save", "slow", 10, 0)]
                     + [("move", "host", s, "disk", s) for s in range(6)])
    runner.before_moves(step, caches)
    threading.Timer(0.3, slow.gate.set).start()
    runner.before_moves(KVStepOps(stores=[("save", "host", 20 + s, s) for s in range(6)]),
                        caches)
    runner.flush()
    # the disk holds what the host slots held before the direct save, the host the new blocks
    runner.after_moves(KVStepOps(loads=[("disk", s, 12 + s) for s in range(6)]
                                 + [("host", s, 26 + s) for s in range(6)]), caches)
    assert runner.take_load_results()[0] == []
    for s in range(6):
        assert block_bytes(caches, 12 + s) == old[s]
        assert block_bytes(caches, 26 + s) == block_bytes(caches, 20 + s)
    runner.close()
