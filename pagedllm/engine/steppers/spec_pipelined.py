"""Speculative decoding with pipeline stages (pipeline_parallel_size > 1): the pipelined
stepper's virtual engines (engine/virtual_engines.py), each a SpecScheduler with its own
drafts, block manager and (on the workers) KV caches, the proposer's included. Each idle engine
plans its step as the speculative stepper does (the guard, then n-gram drafts or the device
proposer's from its previous step), schedules and launches it before the oldest batch in the
stages is read, so up to pipeline_parallel_size batches are in flight; when a batch's outputs
come back, its engine accepts them (rejected drafts' slots released, new drafts carried) as
the speculative stepper does after a step.

A virtual engine has at most one batch in flight, so its drafts always follow the tokens its
previous step emitted. The guard decides per engine's batch (``disable_by_batch_size`` counts
that engine's running sequences) and measures a step from its launch to its outputs.
"""
from __future__ import annotations

import time

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.steppers.base import StepDone
from pagedllm.engine.steppers.pipelined import OnVirtualEngines
from pagedllm.engine.steppers.speculative import SpecStepper
from pagedllm.engine.virtual_engines import VirtualEngines
from pagedllm.spec_decode.scheduler import SpecScheduler
from pagedllm.worker.pending import PendingOutputs


class PipelinedSpecStepper(OnVirtualEngines, SpecStepper):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        assert all(isinstance(s, SpecScheduler) for s in self.schedulers)
        self.engines = VirtualEngines(self.schedulers)
        # virtual engine -> (plan start, speculate, batch size): from its plan to its outputs
        self._plans: dict[int, tuple[float, bool, int]] = {}

    def step(self) -> StepDone | None:
        self.engines.fill(self._launch, before=self._plan_engine)
        entry = self.engines.pop()
        if entry is None:  # nothing to run
            return None
        ve, sched, pending = entry
        sch: SpecScheduler = self.schedulers[ve]  # type: ignore[assignment]
        start, _, batch_size = self._plans.pop(ve)
        outputs = []
        if pending is not None:
            outputs = pending.result()
            self._after(sch, sched, outputs)
            self._measure(sched, outputs, time.perf_counter() - start, batch_size)
        sch.after_step(sched)
        return StepDone(sch, sched, outputs)

    def _plan_engine(self, ve: int) -> None:
        start = time.perf_counter()
        speculate, batch_size = self._plan(self.schedulers[ve])  # type: ignore[arg-type]
        self._plans[ve] = (start, speculate, batch_size)

    def _launch(self, sched: SchedulerOutput) -> PendingOutputs:
        ve = sched.batch.virtual_engine
        sch: SpecScheduler = self.schedulers[ve]  # type: ignore[assignment]
        self._before_launch(sch, sched, self._plans[ve][1])
        return self.executor.submit(sched.batch)
