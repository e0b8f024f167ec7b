"""benchmarks/workloads.py: the workloads are fixed by their seed, have the lengths the issue
names, keep warm-up prompts out of the timed set, and count FLOPs as stated."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import workloads  # noqa: E402

VOCAB = list(range(3, 512))


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workload_is_seeded_and_warmup_differs(name: str) -> None:
    prompts, outs = workloads.make_workload(name, VOCAB, 0)
    again, again_outs = workloads.make_workload(name, VOCAB, 0)
    assert (prompts, outs) == (again, again_outs)
    warm, _ = workloads.make_workload(name, VOCAB, 0, warmup=True)
    assert len(warm) == 4 and not any(w in prompts for w in warm)
    assert workloads.make_workload(name, VOCAB, 1)[0] != prompts


def test_workload_lengths() -> None:
    prompts, outs = workloads.make_workload("variable", VOCAB, 0)
    assert len(prompts) == 128 and all(8 <= len(p) <= 384 for p in prompts)
    assert all(8 <= o <= 160 for o in outs) and len(set(outs)) > 20  # a spread, not one length
    prefill, ones = workloads.make_workload("prefill", VOCAB, 0)
    assert set(ones) == {1} and len(prefill) == 128
    long, long_outs = workloads.make_workload("decode_long", VOCAB, 0)
    assert all(200 <= len(p) <= 384 for p in long) and set(long_outs) == {96}
    shared, _ = workloads.make_workload("shared_prefix", VOCAB, 0)
    assert all(p[:320] == shared[0][:320] and 328 <= len(p) <= 384 for p in shared)


def test_work_flops_by_hand() -> None:
    config = dict(hidden_size=8, intermediate_size=16, vocab_size=10, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
    layers, head = 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16), 10 * 8
    # one prompt of 4 tokens, 2 out: 6 tokens through the layers, 2 sampled rows through the
    # LM head; (query, key) pairs: the prompt's 4^2 / 2 plus 2 outputs at contexts 4 + 1 (the
    # formula's mean of 4 + 2 / 2)
    want = 2.0 * layers * 6 + 2.0 * head * 2 + 4.0 * 2 * 8 * (16 / 2 + 2 * (4 + 1))
    assert workloads.work_flops(config, [[1, 2, 3, 4]], [2]) == pytest.approx(want)
    # a prefix shared by both prompts is counted once
    two = workloads.work_flops(config, [[1, 2, 3, 4], [1, 2, 3, 4]], [2, 2], shared_prefix=4)
    assert two == pytest.approx(want + 2.0 * layers * 2 + 2.0 * head * 2
                                + 4.0 * 2 * 8 * 2 * (4 + 1))
