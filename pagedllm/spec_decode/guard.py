"""When to speculate: ``disable_by_batch_size`` (vLLM's rule), or, when it is not set, an
adaptive guard that measures both modes and keeps the faster, so speculation never makes a
loaded server slower. No torch here.

The adaptive guard keeps, per batch-size bucket (powers of two of the running sequences), the
recent throughput (tokens emitted per second of step time) with and without speculation over
each mode's last 16 steps, the slowest two left out (a step slowed by a co-tenant on shared
cores does not decide, as a moving average's first sample would). It speculates where that
is measured faster, and tries the other mode one step in ``explore_every`` (4x fewer while one
mode is over ``FAR_AHEAD`` times the other) so a bucket follows changes (a workload whose
drafts stop matching, a batch that grew). A bucket with no measurement of a mode tries it
first.

What keeps one bad measurement from deciding for long:
- a mode's first steps in a bucket are not counted (they pay one-time costs: new GEMM shapes,
  kernel selection, the proposer's first forward) — ``skip_first``;
- a device proposer (draft model, EAGLE) only drafts for sequences it follows, and the stepper
  stops following while the guard prefers no speculation, so exploration steps then carry no
  drafts and speculation is never measured again; a bucket whose speculation measurement is
  older than ``remeasure_after`` of its steps (a quarter of that below 8 sequences when it was
  within ``CLOSE`` of plain) forgets it, so the next steps measure it afresh; each time the
  rate it forgets had lost to plain by more than ``CLOSE``, that bucket's period doubles (up to
  ``MAX_BACKOFF`` times): re-measuring a device proposer means following a whole new wave of
  sequences (its pass over their prompts, mirroring their steps), which a loaded server whose
  speculation keeps losing should not pay every ``remeasure_after`` steps;
- below 8 sequences a new request makes a bucket forget a speculation rate that lost to plain
  (``new_sequences``): acceptance belongs to the prompt, not to the bucket.

A bucket that has not measured speculation yet takes the verdict of the nearest smaller bucket
that measured both modes when that verdict is "plain": speculation's gain only shrinks as the
batch grows (the drafts' extra query tokens cost more once a step is compute-bound), so a
larger batch does not pay to learn what a smaller one already showed (vLLM's
``disable_by_batch_size`` rests on the same order). The smaller bucket's own re-measurement
lifts it.

What a device proposer costs outside speculative steps counts against speculation
(``charge``): its pass over the prompts of the sequences it follows and its mirroring of their
plain steps. Plain steps are recorded without that mirroring, so the rate to beat is plain
decoding with the proposer off, which is what the stepper switches to.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


FAR_AHEAD = 2.0  # a mode this many times faster is explored against 4x less often
# below 8 sequences (where one prompt decides a bucket's measurement), speculation measured
# within CLOSE of plain is measured again 4x sooner; a large batch pays more to look again
CLOSE, CLOSE_BUCKETS = 1.25, 3
WINDOW = 16  # the steps a mode's rate is measured over
# from 8 sequences on, a device proposer starts following a new wave only where speculation
# was measured at least this much faster
FOLLOW_MARGIN = 1.1
MAX_BACKOFF = 4  # a speculation rate that lost by far again goes stale after up to 16x the steps


def _bucket(batch_size: int) -> int:
    return max(1, batch_size).bit_length()  # 1, 2-3, 4-7, 8-15, ...


@dataclass
class _Rate:
    """A mode's rate over its last ``WINDOW`` steps: their tokens over their seconds, leaving out
    the slowest eighth of them (at least one) by step time. A step slowed by something else on
    the machine (another process on shared cores) is left out, where in a moving average the
    first such sample would weigh most of the decision; tokens are summed, not a median taken,
    because a speculative step's tokens vary from 1 to k + 1 and throughput is their mean.
    Seconds the mode paid between its steps (``pending``: see SpecGuard.charge) count with the
    step that follows them and are never left out, at their share of a full window while the
    window is filling: a one-time cost (the proposer's pass over a new prompt) weighs on a rate
    measured over its first 6 steps as it does on one over 16. Counted whole, it once made
    speculation at batch 1 (3x plain once measured over a window) look slower than plain after a
    new prompt's first steps, and the rest of that request decoded plain."""
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    samples: int = 0
    pending: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, seconds, self.pending))
        self.pending = 0.0
        self.samples += 1

    @property
    def value(self) -> float:
        if not self.recent:
            return 0.0
        kept = sorted(self.recent, key=lambda entry: entry[1])
        if len(kept) > 2:
            kept = kept[:len(kept) - max(1, len(kept) // 8)]
        charged = sum(c for _, _, c in self.recent) * len(self.recent) / WINDOW
        return sum(t for t, _, _ in kept) / (sum(s for _, s, _ in kept) + charged)


@dataclass
class SpecGuard:
    disable_by_batch_size: int | None = None
    explore_every: int = 32
    # measurements before a mode's average counts (a single step is noisy)
    min_samples: int = 6
    skip_first: int = 6  # a mode's first steps in a bucket, not counted (shapes met first)
    remeasure_after: int = 512  # a bucket's steps after which its speculation rate is stale
    _rates: dict[tuple[int, bool], _Rate] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)
    _seen: dict[tuple[int, bool], int] = field(default_factory=dict)  # record calls per key
    _last_spec: dict[int, int] = field(default_factory=dict)  # step of the last spec sample
    # per bucket: re-measurements in a row that found speculation slower by far (the stale
    # period doubles with each, up to MAX_BACKOFF doublings)
    _backoff: dict[int, int] = field(default_factory=dict)

    def speculate(self, batch_size: int) -> bool:
        """Whether the next step of ``batch_size`` running sequences speculates."""
        if batch_size <= 0:
            return False
        if self.disable_by_batch_size is not None:
            return batch_size < self.disable_by_batch_size
        b = _bucket(batch_size)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        on = self._rates.get((b, True), _Rate())
        off = self._rates.get((b, False), _Rate())
        close = on.value * CLOSE >= off.value
        stale = self.remeasure_after << self._backoff.get(b, 0)
        if b <= CLOSE_BUCKETS and close:
            stale //= 4  # a near miss at a small batch (one hard prompt): look again sooner
        if n - self._last_spec.get(b, n) > stale:
            if on.samples >= self.min_samples and off.samples >= self.min_samples:
                # lost by far again: look less often (a re-measurement makes the proposer
                # follow a whole new wave); a near miss or a win: the base period again
                self._backoff[b] = (min(MAX_BACKOFF, self._backoff.get(b, 0) + 1)
                                    if not close else 0)
            self._rates.pop((b, True), None)  # stale: measure speculation again
            self._last_spec[b] = n
        on, off = (self._rates.get((b, mode), _Rate()) for mode in (True, False))
        if on.samples < self.min_samples:
            return not self._smaller_prefers_plain(b)
        if off.samples < self.min_samples:
            return False
        best = on.value >= off.value
        every = self.explore_every
        if max(on.value, off.value) >= FAR_AHEAD * min(on.value, off.value):
            every *= 4  # far apart: one exploration step costs more than it can find
        return (not best) if n % every == every - 1 else best

    def prefers(self, batch_size: int) -> bool:
        """The mode measured faster at ``batch_size`` (speculation until both are measured),
        without counting a step (``speculate`` decides the steps)."""
        if self.disable_by_batch_size is not None:
            return 0 < batch_size < self.disable_by_batch_size
        b = _bucket(batch_size)
        on, off = (self._rates.get((b, mode), _Rate()) for mode in (True, False))
        if on.samples < self.min_samples:
            return not self._smaller_prefers_plain(b)
        if off.samples < self.min_samples:
            return True
        return on.value >= off.value

    def follows(self, batch_size: int) -> bool:
        """Whether a device proposer should start following new sequences that will decode in a
        batch of ``batch_size``: ``prefers``, and from 8 sequences on, where both modes are
        measured, speculation ahead by ``FOLLOW_MARGIN``. Following a wave there costs the
        proposer's pass over all its prompts and its mirroring until the guard gives up on it;
        a lead within the measurements' noise (a speculation rate taken at a wave's start, over
        short contexts, against plain steps taken later) is not worth that."""
        if not self.prefers(batch_size):
            return False
        if self.disable_by_batch_size is not None:
            return True
        b = _bucket(batch_size)
        both = self._measured(b) if b > CLOSE_BUCKETS else None
        return both is None or both[0].value >= FOLLOW_MARGIN * both[1].value

    def _measured(self, b: int) -> tuple[_Rate, _Rate] | None:
        on, off = (self._rates.get((b, mode)) for mode in (True, False))
        if on is None or off is None or min(on.samples, off.samples) < self.min_samples:
            return None
        return on, off

    def _smaller_prefers_plain(self, b: int) -> bool:
        """The nearest smaller bucket that measured both modes found plain faster."""
        for smaller in range(b - 1, 0, -1):
            both = self._measured(smaller)
            if both is not None:
                return both[1].value > both[0].value
        return False

    def new_sequences(self, batch_size: int) -> None:
        """New sequences join a batch of ``batch_size``. Below 8 sequences, where one prompt's
        drafts decide a bucket's measurement, a speculation rate that lost to plain is
        forgotten: acceptance belongs to the prompt, so the newcomers' drafts are measured
        afresh (a few steps) instead of being judged by the last prompt's."""
        if self.disable_by_batch_size is not None or batch_size <= 0:
            return
        b = _bucket(batch_size)
        both = self._measured(b) if b <= CLOSE_BUCKETS else None
        if both is not None and both[1].value > both[0].value:
            self._rates.pop((b, True), None)
            self._last_spec[b] = self._steps.get(b, 0)

    def charge(self, batch_size: int, seconds: float) -> None:
        """Speculation at ``batch_size`` cost ``seconds`` outside the steps it is measured by: a
        device proposer's pass over the prompts of the sequences it follows and its mirroring
        of their plain steps. They count against the speculative rate with its next step."""
        if self.disable_by_batch_size is not None or seconds <= 0 or batch_size <= 0:
            return
        self._rates.setdefault((_bucket(batch_size), True), _Rate()).pending += seconds

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` sequences emitted ``tokens`` in ``seconds``."""
        if self.disable_by_batch_size is not None or seconds <= 0 or batch_size <= 0:
            return
        key = (_bucket(batch_size), speculated)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if speculated:
            self._last_spec[key[0]] = self._steps.get(key[0], 0)
        if seen <= self.skip_first:
            return
        self._rates.setdefault(key, _Rate()).add(tokens, seconds)

    def rates(self) -> dict[str, float]:
        """The measured tokens/s by bucket and mode (for logs and benchmarks)."""
        return {f"b{1 << (b - 1)}+{'spec' if on else 'plain'}": r.value
                for (b, on), r in sorted(self._rates.items())}
