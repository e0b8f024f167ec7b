"""The scheduled-ahead stepper (backends with ``capabilities.async_output``): step N+1 is
planned and launched before step N's outputs are read, so the device does not wait for the
host's Python work (Scheduler.schedule_ahead says when that plan is sure to be the plain one)."""
from __future__ import annotations

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.steppers.base import StepDone, Stepper
from pagedllm.worker.pending import PendingOutputs


class AheadStepper(Stepper):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._inflight: tuple[SchedulerOutput, PendingOutputs] | None = None
        self.num_steps_ahead = 0  # steps launched before the previous one's outputs were read

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def step(self) -> StepDone:
        if self._inflight is not None:
            (sched, pending), self._inflight = self._inflight, None
        else:
            sched = self.scheduler.schedule()
            pending = None if sched.batch.is_empty() else self._launch(sched)
        # a guided sequence's next mask needs this step's token on the host: no step ahead
        if pending is not None and not self.guided.has_live():
            ahead = self.scheduler.schedule_ahead(sched)
            if ahead is not None:
                self._inflight = (ahead, self._launch(ahead))
                self.num_steps_ahead += 1
        outputs = [] if pending is None else pending.result()
        self.scheduler.after_step(sched)
        return StepDone(self.scheduler, sched, outputs)

    def _launch(self, sched: SchedulerOutput) -> PendingOutputs:
        self._prepare(sched)
        return self.executor.execute_async(sched.batch)
