"""What every stepper shares: the schedulers it drives, the executor it launches on, and the
shape of one step (schedule -> execute -> outputs on the host). No torch here."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.batch import SeqOutput
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import SequenceGroup

if TYPE_CHECKING:
    from pagedllm.engine.guided import GuidedManager
    from pagedllm.executor.base import Executor


@dataclass
class StepDone:
    """A step whose outputs are on the host, ready for the output processor."""

    scheduler: Scheduler  # the scheduler that planned it (frees its finished sequences)
    sched: SchedulerOutput
    outputs: list[SeqOutput]  # parallel to sched.batch.seqs


class Stepper(ABC):
    """Runs the engine's steps in one mode, chosen when the engine starts (make_stepper).

    ``step()`` schedules, executes and returns a step whose outputs are ready (None when there
    was nothing to run); the engine then processes them. A stepper owns what a mode keeps
    between steps (a step launched ahead, the batches in pipeline stages), nothing else.
    """

    num_steps_ahead = 0  # steps launched before the previous one's outputs were read

    def __init__(self, schedulers: list[Scheduler], executor: Executor,
                 guided: GuidedManager) -> None:
        self.schedulers = schedulers
        self.scheduler = schedulers[0]
        self.executor = executor
        self.guided = guided

    def add(self, group: SequenceGroup) -> None:
        """A new request joins a scheduler."""
        self.scheduler.add(group)

    def block_manager_of(self, group: SequenceGroup) -> BlockManager:
        """The block manager holding ``group``'s blocks (a fork shares them there)."""
        return self.scheduler.block_manager

    def forget(self, request_id: str) -> None:
        """``request_id`` finished: drop what the stepper kept about it."""

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's outputs have not been returned yet."""
        return False

    @abstractmethod
    def step(self) -> StepDone | None: ...

    def _prepare(self, sched: SchedulerOutput) -> None:
        """The host-side inputs a launch needs besides the plan: the guided token bitmask."""
        sched.batch.token_bitmask = self.guided.bitmask(sched)
        if self.scheduler.kv is not None:  # block moves recorded after scheduling (evictions)
            self.scheduler.kv.attach(sched.batch)
