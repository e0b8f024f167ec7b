"""Where an offline run's wall time goes, step by step: each engine step's wall time, grouped by
kind (steps with prefill tokens, decode steps scheduled ahead, decode steps that waited), for the
throughput workload (random prompts, greedy, ignore_eos).

    python benchmarks/step_timeline.py --model .carry/llama3-8b-shape --load-format dummy \\
        --device cuda --dtype bfloat16 --num-prompts 1000 --max-num-seqs 512
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from pagedllm import LLM, RequestOutputKind, SamplingParams


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
    start = time.perf_counter()
    while engine.has_unfinished_requests():
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


if __name__ == "__main__":
    main()
