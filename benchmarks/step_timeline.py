"""Where an offline run's wall time goes, step by step: each engine step's wall time, grouped by
kind (steps with prefill tokens, decode steps scheduled ahead, decode steps that waited), for the
throughput workload. It times ``LLM.generate`` over throughput.py's prompts (same seed, greedy,
ignore_eos) after the same warm-up, so its wall time is the benchmark's; the time outside the
engine's steps (adding the requests, gathering the outputs) is reported too.

    python benchmarks/step_timeline.py --model .carry/llama3-8b-shape --load-format dummy \\
        --device cuda --dtype bfloat16 --num-prompts 1000 --max-num-seqs 512
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path

import pagedllm.engine.llm
from pagedllm import LLM, SamplingParams
from throughput import load_model_config, make_prompts, special_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--warmup-prompts", type=int, default=256, help="as throughput.py's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", type=int, nargs=2, action="append", metavar=("FIRST", "COUNT"),
                   help="also print the GPU timeline (profile_decode.py's) of engine steps "
                        "FIRST..FIRST+COUNT-1 and each of those steps' kind and wall time")
    p.add_argument("--gc", choices=["frozen", "freeze-only", "on", "off"], default="frozen",
                   help="Python's garbage collector during the run: frozen (LLM.generate's own: "
                        "the objects alive at the start are not collected and no full "
                        "collection runs), freeze-only (the former without the latter), on "
                        "(plain), off")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, seed=args.seed)
    engine = llm.llm_engine
    config = load_model_config(Path(args.model))
    prompts = [{"prompt_token_ids": ids} for ids in make_prompts(
        args.num_prompts, args.input_len, config["vocab_size"],
        special_ids(Path(args.model), config), args.seed)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.warmup_prompts:
        llm.generate(prompts[: args.warmup_prompts], params, use_tqdm=False)

    scheduled: list = []  # what the plain schedule() returned during the current step() call
    plain_schedule, plain_step = engine.scheduler.schedule, engine.step

    def schedule():  # noqa: ANN202 - records, then behaves as the scheduler's own
        out = plain_schedule()
        scheduled.append(out)
        return out

    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # steps, s, seqs, tokens
    times: dict[str, list[float]] = defaultdict(list)  # kind -> each step's ms
    windows = {first: count for first, count in args.timeline or []}
    state: dict = {"index": 0, "window": None}  # window: [profiler, last step, [(kind, ms)]]

    def step():  # noqa: ANN202 - times and classifies, then returns the engine's own outputs
        index = state["index"]
        if index in windows:
            state["window"] = [_open_timeline(), index + windows[index] - 1, []]
        inflight = getattr(engine.stepper, "_inflight", None)
        scheduled.clear()
        t0 = time.perf_counter()
        outputs = plain_step()
        dt = time.perf_counter() - t0
        # the step this call applied: the one launched ahead by the previous call, else its own
        batch = inflight[0].batch if inflight is not None else scheduled[0].batch
        tokens = sum(s.num_tokens for s in batch.seqs)
        prefill = tokens > len(batch.seqs)
        kind = ("with prefill" if prefill else "decode") + (
            ", launched ahead" if inflight is not None else ", scheduled after the previous")
        row = totals[kind]
        row[0] += 1
        row[1] += dt
        row[2] += len(batch.seqs)
        row[3] += tokens
        times[kind].append(dt * 1e3)
        window = state["window"]
        if window:
            window[2].append((kind, dt * 1e3))
            if index == window[1]:
                _close_timeline(window)
                state["window"] = None
        state["index"] = index + 1
        return outputs

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    engine.step = step  # type: ignore[method-assign]
    if args.gc == "off":
        gc.collect()
        gc.disable()
    elif args.gc == "on":  # LLM.generate's freeze replaced by nothing
        pagedllm.engine.llm.frozen_gc = contextlib.nullcontext  # type: ignore[assignment]
    elif args.gc == "freeze-only":
        pagedllm.engine.llm.frozen_gc = _freeze_only  # type: ignore[assignment]
    gc_log = _GcLog()
    gc.callbacks.append(gc_log)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    gc.callbacks.remove(gc_log)
    in_steps = sum(row[1] for row in totals.values())
    out_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts x {args.input_len}/{args.output_len}, max_num_seqs "
          f"{args.max_num_seqs}, gc {args.gc}: LLM.generate {wall:.2f} s, "
          f"{out_tokens / wall:.0f} output tok/s ({in_steps:.2f} s in {state['index']} engine "
          f"steps, {wall - in_steps:.2f} s outside them), {engine.num_steps_ahead} steps ahead, "
          f"{engine.scheduler.num_preemptions} preemptions")
    gc_log.report()
    print(f"{'kind':45s} {'steps':>6s} {'seconds':>8s} {'ms/step':>8s} {'seqs/step':>9s} "
          f"{'tokens/step':>11s}")
    for kind, (steps, secs, seqs, tokens) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:45s} {steps:6d} {secs:8.2f} {secs / steps * 1e3:8.2f} "
              f"{seqs / steps:9.1f} {tokens / steps:11.1f}")
    print(f"{'kind':45s} {'median':>8s} {'p90':>8s} {'max':>8s} {'s over median':>13s}  slowest")
    for kind, ms in times.items():
        order = sorted(ms)
        median = order[len(order) // 2]
        excess = sum(t - median for t in ms if t > median) / 1e3
        slowest = sorted(range(len(ms)), key=lambda i: -ms[i])[:5]
        print(f"{kind:45s} {median:8.2f} {order[int(len(order) * 0.9)]:8.2f} {order[-1]:8.2f} "
              f"{excess:13.2f}  " + ", ".join(f"#{i} {ms[i]:.1f}" for i in slowest))


class _GcLog:
    """A gc.callbacks entry: each collection's generation and duration; a full collection over
    20 ms is printed at once with where it was entered from and the collector's state."""

    def __init__(self) -> None:
        self.collections: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0
        self._entered: tuple[str, list[str]] | None = None  # thread, stack of a full collection

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            self._entered = None
            if info["generation"] == 2:
                self._entered = (threading.current_thread().name,
                                 traceback.format_stack()[-7:-1])
            return
        secs = time.perf_counter() - self._start
        self.collections.append((info["generation"], secs))
        if self._entered is not None and secs > 0.02:
            thread, stack = self._entered
            print(f"full collection of {secs * 1e3:.1f} ms (collected {info['collected']}, "
                  f"{len(gc.get_objects(2))} objects in generation 2 after it, freeze count "
                  f"{gc.get_freeze_count()}, thresholds {gc.get_threshold()}, counts "
                  f"{gc.get_count()}) in thread {thread}, entered from:\n" + "".join(stack))

    def report(self) -> None:
        for gen in sorted({g for g, _ in self.collections}):
            secs = [t for g, t in self.collections if g == gen]
            print(f"GC generation {gen}: {len(secs)} collections, {sum(secs) * 1e3:.1f} ms in "
                  f"all, longest {max(secs) * 1e3:.1f} ms")


@contextlib.contextmanager
def _freeze_only():  # noqa: ANN202 - gc_freeze.frozen_gc as it was before full collections were held
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _open_timeline():  # noqa: ANN202 - a started torch.profiler
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def _close_timeline(window: list) -> None:
    import torch

    from profile_decode import timeline_table

    prof, last, steps = window
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    print(f"steps {last - len(steps) + 1}..{last}: " +
          ", ".join(f"{kind.split(',')[0]} {ms:.1f} ms" for kind, ms in steps))
    print(timeline_table(prof, len(steps)))


if __name__ == "__main__":
    main()
