"""The speculation guard: disable_by_batch_size as vLLM's, and the adaptive default that keeps
the measured faster mode per batch-size bucket while still trying the other now and then."""
from __future__ import annotations

from pagedllm.spec_decode.guard import SpecGuard


def test_disable_by_batch_size() -> None:
    g = SpecGuard(disable_by_batch_size=4)
    assert [g.speculate(b) for b in (1, 3, 4, 9)] == [True, True, False, False]
    assert not g.speculate(0)


def _run(g: SpecGuard, batch: int, spec_rate: float, plain_rate: float, steps: int) -> float:
    """Fraction of ``steps`` that speculated, feeding the guard the given tokens/s."""
    on = 0
    for _ in range(steps):
        s = g.speculate(batch)
        on += s
        g.record(batch, s, 100, 100 / (spec_rate if s else plain_rate))
    return on / steps


def test_adaptive_keeps_the_faster_mode_per_bucket() -> None:
    g = SpecGuard()
    assert _run(g, 1, spec_rate=200, plain_rate=100, steps=320) > 0.95  # batch 1: spec wins
    assert _run(g, 32, spec_rate=60, plain_rate=100, steps=640) < 0.06  # batch 32: plain wins
    # a bucket's decision does not leak into another, and exploring costs at most ~1/32
    assert _run(g, 1, spec_rate=200, plain_rate=100, steps=64) > 0.95


def test_adaptive_follows_a_change() -> None:
    g = SpecGuard()
    _run(g, 8, spec_rate=200, plain_rate=100, steps=200)
    assert _run(g, 8, spec_rate=50, plain_rate=100, steps=400) < 0.2  # drafts stopped matching


def test_a_mode_s_first_step_is_not_counted() -> None:
    """The first speculative step pays one-time costs (new shapes): 50x slower here, which as
    the first sample of the average would switch speculation off although it is 2x faster."""
    g = SpecGuard()
    first = True
    on = 0
    for _ in range(320):
        s = g.speculate(1)
        on += s
        rate = (4 if first else 200) if s else 100
        first = first and not s
        g.record(1, s, 100, 100 / rate)
    assert on / 320 > 0.9


def test_stale_speculation_is_measured_again() -> None:
    """With a device proposer, steps where the guard prefers no speculation carry no drafts
    (nothing is followed), so exploration measures plain steps only; the speculation rate
    goes stale and is measured again, and a batch where speculation became faster gets it."""
    g = SpecGuard()
    assert _run(g, 4, spec_rate=50, plain_rate=100, steps=200) < 0.1

    def unfollowed(spec_rate: float, steps: int) -> float:
        on = 0
        for _ in range(steps):
            s = g.speculate(4) and g.prefers(4)  # no drafts unless the guard prefers spec
            on += s
            g.record(4, s, 100, 100 / (spec_rate if s else 100))
        return on / steps

    assert unfollowed(spec_rate=300, steps=300) < 0.05  # stale not yet: nothing measured
    assert unfollowed(spec_rate=300, steps=600) > 0.3  # re-measured: speculation back on
    assert unfollowed(spec_rate=300, steps=200) > 0.9


def test_a_larger_batch_takes_a_smaller_one_s_plain_verdict() -> None:
    """Batch 8 measured plain faster: batch 32 runs plain from its first step (no speculative
    steps to learn what batch 8 showed); a smaller bucket that found speculation faster lends
    nothing, and the larger bucket measures for itself."""
    g = SpecGuard()
    assert _run(g, 8, spec_rate=60, plain_rate=100, steps=200) < 0.1
    assert not g.prefers(32)
    assert _run(g, 32, spec_rate=300, plain_rate=100, steps=64) == 0.0
    h = SpecGuard()
    assert _run(h, 8, spec_rate=200, plain_rate=100, steps=200) > 0.9
    assert h.prefers(32)
    assert _run(h, 32, spec_rate=60, plain_rate=100, steps=640) < 0.06


def test_one_slowed_step_does_not_decide() -> None:
    """Speculation is 1.5x faster, but the first of its steps the guard counts ran while another
    process held the cores (10x slower). A moving average started at that sample decided for
    plain for most of the next 160 steps; a window that leaves its slowest steps out does not."""
    g = SpecGuard()
    on = counted = 0
    for _ in range(160):
        s = g.speculate(8)
        on += s
        rate = 150 if s else 100
        if s:
            counted += 1
            if counted == g.skip_first + 1:
                rate = 15
        g.record(8, s, 100, 100 / rate)
    assert on / 160 > 0.8


FULL = {0, 2, 4, 7, 9, 11, 14, 16, 18}  # 9 of every 20 verification steps accept every draft


def test_speculative_rate_is_the_mean_of_what_steps_emit() -> None:
    """A batch-1 verification step emits 1 token (first draft rejected) or k + 1 = 5: here 5 in
    45% of the steps, spread out (any 16 steps in a row hold 6-8 of them), 2.8 on average, 10 ms
    each: 280 tok/s against plain's 200. The median step emits 1 token (100 tok/s), which would
    keep speculation off."""
    g = SpecGuard()
    on = steps = 0
    for _ in range(320):
        s = g.speculate(1)
        on += s
        if s:
            steps += 1
            g.record(1, True, 5 if steps % 20 in FULL else 1, 0.010)
        else:
            g.record(1, False, 1, 0.005)
    assert on / 320 > 0.8


def test_what_speculation_pays_outside_its_steps_counts_against_it() -> None:
    """Decode steps speculating are 1.07x plain (15 vs 14 tokens in 10 ms), but the proposer's
    pass over new prompts costs 20 ms per 8 of them: 1,200 tok/s against 1,400, so plain wins
    (without the charge the guard kept speculating)."""
    g = SpecGuard()
    on = 0
    for _ in range(640):
        s = g.speculate(32)
        on += s
        if s and on % 8 == 0:
            g.charge(32, 0.020)
        g.record(32, s, 15 if s else 14, 0.010)
    assert on / 640 < 0.15


def test_a_new_prompt_at_a_small_batch_is_measured_afresh() -> None:
    """At batch 1 a prompt whose drafts are rejected turns speculation off; the next request's
    drafts may match well, so its arrival forgets the lost measurement (below 8 sequences),
    while a large batch keeps its verdict."""
    g = SpecGuard()
    assert _run(g, 1, spec_rate=50, plain_rate=100, steps=64) < 0.3
    assert not g.prefers(1)
    g.new_sequences(1)
    assert g.prefers(1)
    assert _run(g, 1, spec_rate=250, plain_rate=100, steps=64) > 0.8
    h = SpecGuard()
    _run(h, 32, spec_rate=50, plain_rate=100, steps=64)
    h.new_sequences(32)
    assert not h.prefers(32)


def test_a_one_time_charge_weighs_as_its_share_of_a_window() -> None:
    """The proposer's pass over a new prompt (30 ms) is charged to speculation. Right after a
    batch-1 bucket forgot its speculation rate (a new prompt) only 6 speculative steps are
    measured: counted whole against those 6, the charge made speculation (230 tok/s in its
    steps) look slower than plain (176 tok/s), and the request decoded plain; as a full
    window's share it does not."""
    g = SpecGuard()
    _run(g, 1, spec_rate=50, plain_rate=176, steps=64)  # the last prompt's drafts were rejected
    assert not g.prefers(1)
    g.new_sequences(1)
    g.charge(1, 0.030)
    for _ in range(6):
        assert g.speculate(1)
        g.record(1, True, 2, 0.0087)
    assert g.prefers(1)
    assert _run(g, 1, spec_rate=230, plain_rate=176, steps=64) > 0.9


def test_a_rate_that_keeps_losing_by_far_is_measured_again_less_often() -> None:
    """Each re-measurement of a device proposer follows a whole new wave (its prompt pass and
    mirroring): at batch 32 where speculation runs at half plain's rate, the stale period
    doubles with each re-measurement that confirms it; a near miss keeps the base period, and
    a re-measurement that finds speculation faster switches it back on."""

    def episodes(g: SpecGuard, spec_rate: float, steps: int) -> int:
        count, was = 0, False
        for _ in range(steps):
            s = g.speculate(32) and g.prefers(32)  # no drafts unless the guard prefers spec
            count += s and not was
            was = s
            g.record(32, s, 100, 100 / (spec_rate if s else 100))
        return count

    far = SpecGuard()
    assert _run(far, 32, spec_rate=50, plain_rate=100, steps=100) < 0.15
    assert episodes(far, 50, 12_000) <= 5  # 512, 1024, 2048, 4096 steps apart (and no more)
    near = SpecGuard()
    assert _run(near, 32, spec_rate=90, plain_rate=100, steps=100) < 0.5
    assert episodes(near, 90, 12_000) >= 15  # every ~512 steps
    assert episodes(far, 300, 16_000) >= 1  # the longest period still looks again
    assert _run(far, 32, spec_rate=300, plain_rate=100, steps=200) > 0.9


def test_a_new_wave_at_a_large_batch_is_followed_only_for_a_clear_lead() -> None:
    """Following a new wave costs the proposer's pass over its prompts: at 8+ sequences the
    guard asks speculation to lead by FOLLOW_MARGIN before the proposer starts following new
    sequences (a lead within noise flipped the choice from wave to wave and made every other
    wave pay that pass); below 8, preferring speculation is enough."""
    from pagedllm.spec_decode.guard import FOLLOW_MARGIN

    for batch, spec_rate, follows in ((32, 105, False), (32, 100 * FOLLOW_MARGIN + 5, True),
                                      (4, 105, True), (32, 95, False)):
        g = SpecGuard(explore_every=10**9)  # no exploration: the rates stay as fed
        for _ in range(20):
            for mode, rate in ((True, spec_rate), (False, 100)):
                g.record(batch, mode, 100, 100 / rate)
        assert g.prefers(batch) == (spec_rate >= 100)
        assert g.follows(batch) == follows, (batch, spec_rate)
    fresh = SpecGuard()
    assert fresh.follows(32)  # nothing measured yet: follow, to measure
    assert SpecGuard(disable_by_batch_size=64).follows(32)
    assert not SpecGuard(disable_by_batch_size=16).follows(32)
