"""The scheduler never runs more distinct adapters than max_loras (the workers' device slots):
requests of another adapter wait, in order, while later requests of running adapters (and of
the base model) go ahead; prefix-cache keys are rooted in the adapter. No torch."""
from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

ADAPTERS = {i: LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}


def _group(n: int, lora: int | None) -> SequenceGroup:
    seq = Sequence(n, [5] * 4)
    if lora:
        seq.lora_int_id = lora
    return SequenceGroup(str(n), [seq], SamplingParams(max_tokens=4), arrival_time=float(n),
                         lora_request=ADAPTERS[lora] if lora else None)


def _scheduler(max_loras: int, blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_loras=max_loras)
    return Scheduler(config, BlockManager(4, blocks, num_host_blocks=64), can_swap=True)


def _adapters(out) -> set[int]:
    return {s.lora_request.lora_int_id for s in out.batch.seqs if s.lora_request is not None}


def test_admission_keeps_to_max_loras() -> None:
    sched = _scheduler(max_loras=2)
    loras = [1, 2, 3, None, 1, 3, 2]
    for n, lora in enumerate(loras):
        sched.add(_group(n, lora))
    out = sched.schedule()
    assert _adapters(out) == {1, 2}
    # adapter 3 waits; the base request and adapter 1's and 2's later ones went ahead
    assert [s.seq_id for s in out.batch.seqs] == [0, 1, 3, 4, 6]
    assert [g.request_id for g in sched.waiting] == ["2", "5"]  # order kept
    for group in list(sched.running):  # adapters 1 and 2 finish
        if group.lora_int_id:
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_STOPPED
    sched.free_finished()
    out = sched.schedule()
    assert 3 in _adapters(out) and not sched.waiting


def test_lora_off_admits_everything() -> None:
    sched = _scheduler(max_loras=0)
    for n, lora in enumerate([1, 2, 3]):
        sched.add(_group(n, lora))
    assert _adapters(sched.schedule()) == {1, 2, 3}


def test_block_keys_are_rooted_in_the_adapter() -> None:
    bm = BlockManager(4, 16, enable_caching=True)
    a, b, c = Sequence(0, list(range(9))), Sequence(1, list(range(9))), Sequence(2, list(range(9)))
    a.lora_int_id, b.lora_int_id = 1, 2
    keys = [bm._block_keys(s, 2) for s in (a, b, c)]
    assert keys[0] != keys[1] and keys[0] != keys[2] and keys[1] != keys[2]
    d = Sequence(3, list(range(9)))
    d.lora_int_id = 1
    assert bm._block_keys(d, 2) == keys[0]
