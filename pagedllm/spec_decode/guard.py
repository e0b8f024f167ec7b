"""When to speculate: ``disable_by_batch_size`` (vLLM's rule), or, when it is not set, an
adaptive guard that measures both modes and keeps the faster, so speculation never makes a
loaded server slower. No torch here.

The adaptive guard keeps, per batch-size bucket (powers of two of the running sequences), the
recent throughput (tokens emitted per second of step time) with and without speculation, as
exponential moving averages. It speculates where that is measured faster, and tries the other
mode one step in ``explore_every`` so a bucket follows changes (a workload whose drafts stop
matching, a batch that grew). A bucket with no measurement of a mode tries it first.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _bucket(batch_size: int) -> int:
    return max(1, batch_size).bit_length()  # 1, 2-3, 4-7, 8-15, ...


@dataclass
class _Rate:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.samples == 0 else (1 - alpha) * self.value + alpha * x
        self.samples += 1


@dataclass
class SpecGuard:
    disable_by_batch_size: int | None = None
    explore_every: int = 32
    alpha: float = 0.25
    # measurements before a mode's average counts (a single step is noisy)
    min_samples: int = 3
    _rates: dict[tuple[int, bool], _Rate] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)

    def speculate(self, batch_size: int) -> bool:
        """Whether the next step of ``batch_size`` running sequences speculates."""
        if batch_size <= 0:
            return False
        if self.disable_by_batch_size is not None:
            return batch_size < self.disable_by_batch_size
        b = _bucket(batch_size)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        on, off = (self._rates.get((b, mode), _Rate()) for mode in (True, False))
        if on.samples < self.min_samples:
            return True
        if off.samples < self.min_samples:
            return False
        best = on.value >= off.value
        return (not best) if n % self.explore_every == self.explore_every - 1 else best

    def prefers(self, batch_size: int) -> bool:
        """The mode measured faster at ``batch_size`` (speculation until both are measured),
        without counting a step (``speculate`` decides the steps)."""
        if self.disable_by_batch_size is not None:
            return 0 < batch_size < self.disable_by_batch_size
        b = _bucket(batch_size)
        on, off = (self._rates.get((b, mode), _Rate()) for mode in (True, False))
        if on.samples < self.min_samples or off.samples < self.min_samples:
            return True
        return on.value >= off.value

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` sequences emitted ``tokens`` in ``seconds``."""
        if self.disable_by_batch_size is not None or seconds <= 0 or batch_size <= 0:
            return
        key = (_bucket(batch_size), speculated)
        self._rates.setdefault(key, _Rate()).add(tokens / seconds, self.alpha)

    def rates(self) -> dict[str, float]:
        """The measured tokens/s by bucket and mode (for logs and benchmarks)."""
        return {f"b{1 << (b - 1)}+{'spec' if on else 'plain'}": r.value
                for (b, on), r in sorted(self._rates.items())}
