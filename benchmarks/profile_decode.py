"""Where a decode step's time goes: wall ms per engine step at a batch size, a cProfile of the
engine's Python work, with --gpu-table torch.profiler's per-kernel GPU time, and with --timeline
the GPU timeline of a few steps: time per kernel class and the idle gaps between kernels.

    python benchmarks/profile_decode.py --model .carry/llama3-8b-shape --load-format dummy \\
        --device cuda --dtype bfloat16 --batch 256 --batch 1 --gpu-table
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import time
from pathlib import Path

import torch

from pagedllm import LLM, RequestOutputKind, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, action="append", help="repeatable; default 256")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gpu-table", action="store_true")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--disable-async-output-proc", action="store_true",
                   help="wait for each step before scheduling the next (the engine's plain path)")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=max(args.batch or [256]),
              disable_async_output_proc=args.disable_async_output_proc)
    engine = llm.llm_engine
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rng = random.Random(0)
    vocab = min(4000, engine.config.model.get_vocab_size())
    # like LLM.generate: outputs only when a request finishes
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 10, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    gc_seconds = [0.0, 0.0]  # total, start of the current collection

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_seconds[1] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_seconds[1]

    gc.callbacks.append(on_gc)

    def timed(k: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(k):
            engine.step()
        sync()
        return (time.perf_counter() - start) / k * 1e3

    for batch in args.batch or [256]:
        for i in range(batch):
            ids = [rng.randint(10, vocab - 1) for _ in range(args.input_len)]
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": ids}, params)
        while engine.stats().num_waiting:  # prefill everything; then only decode steps remain
            engine.step()
        timed(3)
        gc_seconds[0] = 0.0
        ms = timed(args.steps)
        print(f"batch {batch}: {ms:.2f} ms per decode step "
              f"({gc_seconds[0] / args.steps * 1e3:.2f} ms of it in Python's garbage collector)")
        prof = cProfile.Profile()
        prof.enable()
        ms = timed(args.steps)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(f"batch {batch}: {ms:.2f} ms per step under cProfile\n{out.getvalue()}")
        if args.gpu_table and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as gpu:
                timed(5)
            print(gpu.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        if args.timeline and torch.cuda.is_available():
            print(f"batch {batch}: GPU timeline of 5 steps\n{gpu_timeline(lambda: timed(5), 5)}")
        while engine.has_unfinished_requests():
            engine.step()


# kernel name fragment -> class, first match wins
KERNEL_CLASSES = [("splitKreduce", "split-K reduce"), ("paged_attention_reduce", "attention reduce"),
                  ("paged_attention", "attention"), ("reshape_and_cache", "cache write"),
                  ("rotary", "rotary"), ("rms_norm", "rms_norm"), ("silu", "silu_and_mul"),
                  ("gemm", "GEMM"), ("gemv", "GEMM"), ("nvjet", "GEMM"), ("cutlass", "GEMM"),
                  ("xmma", "GEMM")]


def gpu_timeline(run, steps: int) -> str:
    """Runs ``run`` under torch.profiler and tabulates its CUDA kernels: per class the count and
    time per step, and the idle time between consecutive kernels charged to the kernel after it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return timeline_table(prof, steps)


def timeline_table(prof, steps: int) -> str:  # noqa: ANN001 - a finished torch.profiler
    """The table ``gpu_timeline`` prints, for the kernels ``prof`` recorded over ``steps`` steps."""
    import json
    import tempfile
    from collections import defaultdict

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return "no kernels recorded"
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, busy us, gap us
    end = kernels[0]["ts"]
    idle = 0.0  # GPU idle time at step boundaries (the host not keeping up)
    for k in kernels:
        name = k["name"]
        cls = next((c for frag, c in KERNEL_CLASSES if frag in name), name[:40])
        gap = max(0.0, k["ts"] - end)
        row = rows[cls]
        row[0] += 1
        row[1] += k["dur"]
        row[2] += gap if gap < 1000 else 0.0  # a step boundary's host wait is not a kernel gap
        idle += gap if gap >= 1000 else 0.0
        end = max(end, k["ts"] + k["dur"])
    span = (end - kernels[0]["ts"]) / steps
    lines = [f"{'class':40s} {'per step':>8s} {'busy us':>9s} {'gap before us':>13s}"]
    for cls, (n, busy, gap) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{cls:40s} {n / steps:8.1f} {busy / steps:9.1f} {gap / steps:13.1f}")
    busy = sum(r[1] for r in rows.values()) / steps
    gaps = sum(r[2] for r in rows.values()) / steps
    lines.append(f"{'total':40s} {sum(r[0] for r in rows.values()) / steps:8.1f} {busy:9.1f} "
                 f"{gaps:13.1f}   (first to last kernel: {span:.1f} us per step, "
                 f"{idle / steps:.1f} of it idle over 1 ms gaps)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
