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


def _round(elapsed: float, tokens: list[list[int]]) -> dict:
    return {"workloads": {"fixed": {"elapsed_s": elapsed, "token_ids": tokens}}}


def test_repeats_report_the_median_round_and_the_spread() -> None:
    facts = {"fixed": dict(requests=2, prompt_tokens=4, output_tokens=2, flops=8e9)}
    runs = {"pagedllm": [_round(t, [[1], [2]]) for t in (3.0, 1.0, 2.0)],
            "vllm": [_round(t, [[1], [2]]) for t in (4.0, 6.0, 5.0)]}
    summary = workloads.summarize(runs, facts, peak=8.0)
    assert summary["fixed"]["pagedllm"]["elapsed_s"] == 2.0  # the median, not the first
    assert summary["fixed"]["pagedllm"]["peak_fraction"] == pytest.approx(0.5)
    rows = [line for line in workloads.report_lines("bfloat16", summary, facts)
            if line.startswith("| fixed")]
    assert "| 2.00 [1.00-3.00] |" in rows[0]
    assert "| 5.00 [4.00-6.00] |" in rows[1] and rows[1].endswith("| 2.50x |")


def test_serving_report_ratio_is_pagedllm_over_vllm() -> None:
    import serve_workloads

    def summary(tps: float) -> dict:
        return {"prefill": dict(completed=2, output_throughput=tps, ttft_ms={"median": 1.0},
                                tpot_ms={"median": 2.0})}

    rounds = {"pagedllm": [summary(30.0), summary(10.0), summary(20.0)],
              "vllm": [summary(8.0), {"error": "exit 1"}, summary(12.0)]}
    rows = [line for line in serve_workloads.report(rounds, ["prefill"], "bfloat16")
            if line.startswith("| prefill")]
    assert "| 20.0 [10.0-30.0] |" in rows[0]
    assert "| 10.0 [8.0-12.0] |" in rows[1] and rows[1].endswith("| 2.00x |")
