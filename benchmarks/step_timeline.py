"""Where an offline run's wall time goes, step by step: each engine step's wall time, grouped by
kind (steps with prefill tokens, decode steps scheduled ahead, decode steps that waited), for the
throughput workload (random prompts, greedy, ignore_eos).

    python benchmarks/step_timeline.py --model .carry/llama3-8b-shape --load-format dummy \\
        --device cuda --dtype bfloat16 --num-prompts 1000 --max-num-seqs 512
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import random
import time
from collections import defaultdict

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm.engine.gc_freeze import frozen_gc


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
    p.add_argument("--timeline", type=int, nargs=2, action="append", metavar=("FIRST", "COUNT"),
                   help="also print the GPU timeline (profile_decode.py's) of engine steps "
                        "FIRST..FIRST+COUNT-1 and each of those steps' kind and wall time")
    p.add_argument("--gc", choices=["frozen", "on", "off"], default="frozen",
                   help="Python's garbage collector during the run: frozen (as LLM.generate: "
                        "the objects alive at the start are not collected), on (plain), off")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs)
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = min(4000, engine.config.model.get_vocab_size())
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(args.num_prompts):
        ids = [rng.randint(10, vocab - 1) for _ in range(args.input_len)]
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)

    scheduled: list = []  # what the plain schedule() returned during the current step() call
    plain_schedule = engine.scheduler.schedule

    def schedule():  # noqa: ANN202 - records, then behaves as the scheduler's own
        out = plain_schedule()
        scheduled.append(out)
        return out

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # steps, s, seqs, tokens
    times: dict[str, list[float]] = defaultdict(list)  # kind -> each step's ms
    if args.gc == "off":
        gc.collect()
        gc.disable()
    frozen = frozen_gc() if args.gc == "frozen" else contextlib.nullcontext()
    windows = {first: count for first, count in args.timeline or []}
    window: list = []  # [profiler, last step, [(kind, ms)]] while one is open
    with frozen:
        start = time.perf_counter()
        index = 0
        while engine.has_unfinished_requests():
            if index in windows:
                window = [_open_timeline(), index + windows[index] - 1, []]
            inflight = engine._inflight
            scheduled.clear()
            t0 = time.perf_counter()
            engine.step()
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
            if window:
                window[2].append((kind, dt * 1e3))
                if index == window[1]:
                    _close_timeline(window)
                    window = []
            index += 1
        wall = time.perf_counter() - start
    out_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts x {args.input_len}/{args.output_len}, max_num_seqs "
          f"{args.max_num_seqs}: {wall:.2f} s, {out_tokens / wall:.0f} output tok/s, "
          f"{engine.num_steps_ahead} steps ahead, {engine.scheduler.num_preemptions} preemptions")
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
