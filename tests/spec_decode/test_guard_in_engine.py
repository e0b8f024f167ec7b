"""The guard inside the engine: a plain step is judged without the time the device proposer
spent mirroring it (the rate to beat is plain decoding with the proposer off, which the stepper
switches to), and that time and the proposer's pass over new prompts are charged to
speculation, measured by the worker's runner on real steps of the demo model and its shipped
draft model."""
from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.models.demo import DEMO_DIR

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
           "def fib(n):\n    if n < 2:\n        return n\n    return ",
           "for i in range(10):\n    print("]


def test_plain_steps_are_recorded_without_the_proposer_time() -> None:
    llm = LLM(DEMO_DIR, device="cpu", dtype="float32", seed=0, max_num_seqs=4,
              speculative_config={"method": "draft", "num_speculative_tokens": 2})
    engine = llm.llm_engine
    stepper, runner = engine.stepper, engine.executor.worker.spec_runner
    proposer_s: list[float] = []
    execute = runner.execute

    def spy_execute(batch, caches):  # the real step; its first output's proposer time kept
        outputs = execute(batch, caches)
        proposer_s.append(outputs[0].proposer_s if outputs else 0.0)
        return outputs

    steps: list[tuple[bool, float, float, float]] = []  # (plain, step s, recorded s, proposer s)
    measure, record, charge = stepper._measure, stepper.guard.record, stepper.guard.charge
    seen: dict[str, float] = {}
    charged: list[float] = []

    def spy_charge(batch_size, seconds):
        charged.append(seconds)
        return charge(batch_size, seconds)

    def spy_record(batch_size, speculated, tokens, seconds):
        seen["seconds"] = seconds
        return record(batch_size, speculated, tokens, seconds)

    def spy_measure(sched, outputs, seconds, batch_size):
        seen.clear()
        measure(sched, outputs, seconds, batch_size)
        if "seconds" in seen:
            plain = not any(s.num_spec_tokens for s in sched.batch.seqs)
            steps.append((plain, seconds, seen["seconds"], proposer_s[-1]))

    (runner.execute, stepper._measure, stepper.guard.record,
     stepper.guard.charge) = spy_execute, spy_measure, spy_record, spy_charge
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    mirrored_plain = [s for s in steps if s[0] and s[3] > 0]
    assert mirrored_plain, "no plain step with the proposer following was measured"
    for _, step_s, recorded_s, prop_s in mirrored_plain:
        assert recorded_s == step_s - min(prop_s, step_s / 2)
    # speculative steps are judged whole (their proposer time is the price of the drafts)
    assert all(rec == step for plain, step, rec, _ in steps if not plain)
    assert any(not plain for plain, *_ in steps)
    # the proposer's pass over the prompts and its mirroring of plain steps count against
    # speculation: every second of proposer time outside speculative steps is charged
    plain_mirror = sum(min(p, step / 2) for plain, step, _, p in steps if plain)
    assert sum(charged) > plain_mirror > 0


def test_a_new_request_alone_is_speculated_again_after_a_hard_one() -> None:
    """The guard measured speculation slower at batch 1 (a prompt whose drafts were rejected):
    the next request is still followed by the proposer and speculates, measured afresh."""
    llm = LLM(DEMO_DIR, device="cpu", dtype="float32", seed=0, max_num_seqs=1,
              speculative_config={"method": "draft", "num_speculative_tokens": 2})
    stepper = llm.llm_engine.stepper
    guard = stepper.guard
    for _ in range(guard.skip_first + guard.min_samples + 2):  # speculation lost at batch 1
        guard.record(1, True, 1, 0.010)
        guard.record(1, False, 1, 0.001)
    assert not guard.prefers(1)
    before = stepper.metrics.num_spec_steps
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    llm.shutdown()
    assert stepper.metrics.num_spec_steps - before >= guard.min_samples
