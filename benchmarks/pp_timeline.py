"""Is the pipeline kept full? PP=2 on the cpu (one worker process per stage, gloo; or with
--device cuda, one GPU per stage, NCCL) with the virtual engines keeping two batches in flight,
against a naive pipeline (one batch in all the stages at a time) in the same run, on the same
engine, the same requests and the same batches.

    python benchmarks/pp_timeline.py [--model PATH] [--num-prompts 16] [--input-len 32] \\
        [--output-len 64] [--repeats 3] [--trace pp_trace.json] [--json results.json]

Each worker records its steps as (start, end) on the host's monotonic clock, leaving out the
wait for the previous stage's activations; a stage's busy fraction is its steps' time over the
run's wall time. Without --model the random-weight 99M Llama of make_model.py (bench99m, 8
layers: 4 per stage) is built into a cache dir. --trace writes the last repeat's steps of both
modes in the Chrome trace format (chrome://tracing, ui.perfetto.dev). Run it on a quiet machine:
the two stages need one core each, and the driver process a little more.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("pp_timeline")

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CACHE = Path.home() / ".cache" / "pagedllm" / "bench"
MODES = (("naive", 1), ("pipelined", 2))  # (name, batches in flight)

Span = tuple[float, float]


def busy_fraction(spans: list[Span], start: float, end: float) -> float:
    """Share of [start, end] covered by ``spans`` (a stage's steps never overlap)."""
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
    return covered / max(end - start, 1e-9)


def default_model() -> str:
    sys.path.insert(0, str(BENCH_DIR))
    from make_model import write_checkpoint

    out = DEFAULT_CACHE / "bench99m-float32"
    if not (out / "config.json").exists():
        write_checkpoint(out, "bench99m", "float32", 0)
    return str(out)


def run_mode(llm: Any, prompts: list[list[int]], output_len: int, in_flight: int) -> dict:
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    engine.stepper.engines.max_in_flight = in_flight
    engine.executor.stage_timelines()  # clear what earlier runs left
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    end = time.monotonic()
    timelines = engine.executor.stage_timelines()
    tp = engine.config.parallel.tensor_parallel_size
    stages = timelines[::tp]  # TP rank 0 of each stage
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": end - start, "tokens": tokens, "tok_s": tokens / (end - start),
            "busy": [busy_fraction(s, start, end) for s in stages],
            "steps": [len(s) for s in stages], "start": start, "spans": stages,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def chrome_trace(runs: dict[str, dict]) -> dict:
    """The steps of each mode as complete events, one process per mode, one thread per stage."""
    events = []
    for pid, (mode, run) in enumerate(runs.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": mode}})
        for stage, spans in enumerate(run["spans"]):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage,
                           "args": {"name": f"stage {stage}"}})
            for a, b in spans:
                events.append({"name": "step", "ph": "X", "pid": pid, "tid": stage,
                               "ts": (a - run["start"]) * 1e6, "dur": (b - a) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local HF folder (default: bench99m)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="a backend that declares pipeline "
                        "parallelism (cpu, cuda: one device per stage)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode, round robin; medians are reported")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the last repeat")
    parser.add_argument("--json", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from pagedllm import LLM, SamplingParams

    model = args.model or default_model()
    llm = LLM(model, device=args.device, dtype=args.dtype,
              pipeline_parallel_size=args.pipeline_parallel_size,
              tensor_parallel_size=args.tensor_parallel_size)
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model.get_vocab_size()
    prompts = [[rng.randint(3, vocab - 1) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],  # warm-up
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        results: dict[str, list[dict]] = {name: [] for name, _ in MODES}
        for _ in range(args.repeats):
            for name, in_flight in MODES:
                run = run_mode(llm, prompts, args.output_len, in_flight)
                results[name].append(run)
                logger.info("%-9s %7.1f tok/s  busy %s  (%d steps per stage)", name,
                            run["tok_s"], " / ".join(f"{b:.0%}" for b in run["busy"]),
                            run["steps"][0])
    finally:
        llm.llm_engine.shutdown()
    same = all(r["outputs"] == results["naive"][0]["outputs"] for rs in results.values()
               for r in rs)
    summary = {name: {"tok_s": statistics.median(r["tok_s"] for r in runs),
                      "busy": [statistics.median(r["busy"][i] for r in runs)
                               for i in range(len(runs[0]["busy"]))]}
               for name, runs in results.items()}
    ratio = summary["pipelined"]["tok_s"] / summary["naive"]["tok_s"]
    print(f"\n{'mode':<10} {'tok/s':>8}  busy per stage (medians of {args.repeats})")
    for name, s in summary.items():
        print(f"{name:<10} {s['tok_s']:8.1f}  " + " / ".join(f"{b:.0%}" for b in s["busy"]))
    print(f"pipelined / naive: {ratio:.2f}x; greedy tokens identical in every run: {same}")
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace(
            {name: runs[-1] for name, runs in results.items()})))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "summary": summary, "ratio": ratio, "same_tokens": same,
            "cpus": len(os.sched_getaffinity(0))}, indent=2))


if __name__ == "__main__":
    main()
