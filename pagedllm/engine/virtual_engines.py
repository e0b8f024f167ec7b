"""Keeping a pipeline full: one scheduler per virtual engine (vLLM 0.7's design).

With ``pipeline_parallel_size`` N the engine has N virtual engines, each a Scheduler with its
own BlockManager (and, on the workers, its own KV cache), and each request belongs to one of
them for its whole life. A virtual engine has at most one batch in flight, so its scheduler
never plans a step before the previous one's tokens are on the host; batches of different
virtual engines share nothing, so up to N of them can be in the N stages at once. No torch here.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import SequenceGroup
from pagedllm.worker.pending import PendingOutputs

InFlight = tuple[int, SchedulerOutput, "PendingOutputs | None"]  # (virtual engine, step, outputs)


class VirtualEngines:
    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers
        # batches in flight at most; 1 makes a naive pipeline (one batch in all stages at a
        # time), which benchmarks/pp_timeline.py compares against
        self.max_in_flight = len(schedulers)
        self.in_flight: deque[InFlight] = deque()  # oldest first
        self._engine_of: dict[str, int] = {}  # request id -> its virtual engine
        self._next = 0  # where the next round of launches starts (round-robin)

    def assign(self, group: SequenceGroup) -> Scheduler:
        """The scheduler a new request joins: the one with the fewest unfinished requests."""
        ve = min(range(len(self.schedulers)), key=lambda v: self.schedulers[v].num_unfinished())
        self._engine_of[group.request_id] = ve
        return self.schedulers[ve]

    def block_manager_of(self, group: SequenceGroup) -> BlockManager:
        return self.schedulers[self._engine_of.get(group.request_id, 0)].block_manager

    def forget(self, request_id: str) -> None:
        self._engine_of.pop(request_id, None)

    def fill(self, launch: Callable[[SchedulerOutput], PendingOutputs],
             before: Callable[[int], None] | None = None) -> None:
        """Every idle virtual engine with requests schedules its next batch and ``launch``es it,
        while fewer than ``max_in_flight`` batches are in flight. ``before(ve)`` runs right
        before engine ``ve`` schedules (speculative decoding sets its drafts there)."""
        busy = {ve for ve, _, _ in self.in_flight}
        n, first = len(self.schedulers), self._next
        for k in range(n):  # each engine at most once (one batch in flight per engine)
            if len(self.in_flight) >= self.max_in_flight:
                return
            ve = (first + k) % n
            scheduler = self.schedulers[ve]
            if ve in busy or not scheduler.has_unfinished():
                continue
            if before is not None:
                before(ve)
            sched = scheduler.schedule()
            sched.batch.virtual_engine = ve
            pending = None if sched.batch.is_empty() else launch(sched)
            self.in_flight.append((ve, sched, pending))
            self._next = (ve + 1) % n

    def pop(self) -> InFlight | None:
        """The oldest batch in flight (its outputs are read next), or None."""
        return self.in_flight.popleft() if self.in_flight else None
