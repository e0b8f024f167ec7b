"""One stepper per engine mode, chosen once when the engine starts:

- ``PlainStepper``: schedule, execute, return the outputs (the default);
- ``AheadStepper``: plans and launches step N+1 while step N runs (``async_output`` backends
  with an executor that returns before the device is done);
- ``PipelinedStepper``: a scheduler per virtual engine, several batches in the pipeline stages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.steppers.ahead import AheadStepper
from pagedllm.engine.steppers.base import StepDone, Stepper
from pagedllm.engine.steppers.pipelined import PipelinedStepper
from pagedllm.engine.steppers.plain import PlainStepper

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.backend import Backend
    from pagedllm.engine.guided import GuidedManager
    from pagedllm.executor.base import Executor

__all__ = ["AheadStepper", "PipelinedStepper", "PlainStepper", "StepDone", "Stepper",
           "make_stepper"]


def make_stepper(config: EngineConfig, backend: Backend, executor: Executor,
                 schedulers: list[Scheduler], guided: GuidedManager) -> Stepper:
    """The stepper for this engine: pipelined with more than one virtual engine; else ahead
    where the backend declares async_output, the executor can return before the device is done
    and the user did not turn it off; else plain."""
    if len(schedulers) > 1:
        return PipelinedStepper(schedulers, executor, guided)
    if (backend.capabilities.async_output and executor.supports_async
            and not config.disable_async_output_proc):
        return AheadStepper(schedulers, executor, guided)
    return PlainStepper(schedulers, executor, guided)
