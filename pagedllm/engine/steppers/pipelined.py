"""The pipelined stepper (pipeline_parallel_size > 1): one scheduler per virtual engine, and
every idle one launches its next batch before the oldest batch in the stages is read, so up to
pipeline_parallel_size batches are in flight (engine/virtual_engines.py)."""
from __future__ import annotations

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sequence import SequenceGroup
from pagedllm.engine.steppers.base import StepDone, Stepper
from pagedllm.engine.virtual_engines import VirtualEngines
from pagedllm.worker.pending import PendingOutputs


class OnVirtualEngines:
    """A stepper over virtual engines (``self.engines``, set by its constructor): requests,
    their block managers and what is in flight are the engines'. Mixed in before the stepper
    base, whose single-scheduler versions it replaces."""

    engines: VirtualEngines

    def add(self, group: SequenceGroup) -> None:
        self.engines.assign(group).add(group)

    def block_manager_of(self, group: SequenceGroup) -> BlockManager:
        return self.engines.block_manager_of(group)

    def forget(self, request_id: str) -> None:
        self.engines.forget(request_id)

    @property
    def in_flight(self) -> bool:
        return bool(self.engines.in_flight)


class PipelinedStepper(OnVirtualEngines, Stepper):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.engines = VirtualEngines(self.schedulers)

    def step(self) -> StepDone | None:
        self.engines.fill(self._launch)
        entry = self.engines.pop()
        if entry is None:  # nothing to run
            return None
        ve, sched, pending = entry
        outputs = [] if pending is None else pending.result()
        self.schedulers[ve].after_step(sched)
        return StepDone(self.schedulers[ve], sched, outputs)

    def _launch(self, sched: SchedulerOutput) -> PendingOutputs:
        self._prepare(sched)
        return self.executor.submit(sched.batch)
