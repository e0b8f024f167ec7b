"""A launched step's outputs, read once the device is done (no torch here: the engine holds it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.batch import SeqOutput

if TYPE_CHECKING:
    from pagedllm.worker.sampler import PendingSamples


class PendingOutputs:
    """A launched step's outputs; ``result()`` waits for the device and returns them."""

    def __init__(self, outputs: list[SeqOutput], sample_rows: list[int] | None = None,
                 samples: PendingSamples | None = None) -> None:
        self._outputs = outputs  # prompt logprobs already filled in
        self._sample_rows = sample_rows or []  # batch index of each sampled row
        self._samples = samples

    def done(self) -> bool:
        """Whether the device has finished the step (True when nothing is pending)."""
        return self._samples is None or self._samples.done()

    def result(self) -> list[SeqOutput]:
        if self._samples is not None:
            got = self._samples.result(len(self._sample_rows))
            for i, samples in zip(self._sample_rows, got):
                self._outputs[i].samples = samples
            self._samples = None
        return self._outputs
