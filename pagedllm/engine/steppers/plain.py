"""The plain stepper: one step at a time, the device's outputs read before the next is planned."""
from __future__ import annotations

from pagedllm.engine.steppers.base import StepDone, Stepper


class PlainStepper(Stepper):
    def step(self) -> StepDone:
        sched = self.scheduler.schedule()
        outputs = []
        if not sched.batch.is_empty():
            self._prepare(sched)
            outputs = self.executor.execute(sched.batch)
        self.scheduler.after_step(sched)
        return StepDone(self.scheduler, sched, outputs)
