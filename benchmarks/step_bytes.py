"""Bytes the executor sends to its workers per step (issue 42): the pickled payload of each
``execute`` call, as MultiprocExecutor sends it, for a batch of long sequences.

Drives the real Scheduler and BlockManager without a model (device-free, seconds): ``--batch``
requests with ``--context`` - ``--decode-steps`` prompt tokens are prefilled in one step, then
all of them decode together until each holds ``--context`` tokens; every step's payload is
pickled as the executor pickles it.
The "full batch" column is the ScheduledBatch itself (what every step sent before workers kept
per-request state: each sequence's whole block table, and its whole token history when
penalties need it); "sent" is what the executor sends now. ``--penalties`` gives every request
a repetition penalty (the history case).

    python benchmarks/step_bytes.py --batch 256 --context 2048
"""
from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

try:  # the executor's step encoder (workers keep per-request state)
    from pagedllm.executor.step_encoder import StepEncoder
except ImportError:  # before it: the executor sent the ScheduledBatch itself
    StepEncoder = None  # type: ignore[assignment,misc]


def payload_bytes(obj: object) -> int:
    return len(pickle.dumps(("execute", (obj,)), protocol=pickle.HIGHEST_PROTOCOL))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--penalties", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    prompt_len = args.context - args.decode_steps
    blocks = args.batch * (-(-args.context // args.block_size) + 1)
    cfg = SchedulerConfig(max_num_seqs=args.batch,  # every prompt in the first step
                          max_num_batched_tokens=max(args.batch * prompt_len, args.context))
    cfg.resolve(args.context)
    sched = Scheduler(cfg, BlockManager(args.block_size, blocks, 0, watermark=0.0))
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True,
                            repetition_penalty=1.1 if args.penalties else 1.0)
    for i in range(args.batch):
        prompt = [rng.randrange(args.vocab) for _ in range(prompt_len)]
        sched.add(SequenceGroup(str(i), [Sequence(i, prompt)], params, arrival_time=time.time()))
    encoder = StepEncoder(args.block_size) if StepEncoder is not None else None
    rows: dict[str, list[tuple[int, int]]] = {"prefill": [], "decode": []}
    while sched.has_unfinished():
        out = sched.schedule()
        batch = out.batch
        full = payload_bytes(batch)
        sent = payload_bytes(encoder.encode(batch)) if encoder is not None else full
        kind = "decode" if all(s.num_tokens == 1 for s in batch.seqs) else "prefill"
        rows[kind].append((full, sent))
        sched.after_step(out)
        for (group, seq), s in zip(out.entries, batch.seqs):
            if s.num_samples:
                seq.append_token(rng.randrange(args.vocab), 0.0, None)
                if seq.num_output_tokens >= args.decode_steps:
                    seq.status = SequenceStatus.FINISHED_LENGTH
        sched.free_finished()
    print(f"batch {args.batch}, context {args.context} ({prompt_len} prompt + "
          f"{args.decode_steps} decoded), block size {args.block_size}, penalties "
          f"{'on' if args.penalties else 'off'}, sender: "
          f"{'StepEncoder' if encoder is not None else 'the ScheduledBatch (no encoder)'}")
    print(f"{'step':8s} {'steps':>5s} {'full batch B/step':>18s} {'sent B/step':>12s} "
          f"{'sent B/seq':>10s} {'ratio':>7s}")
    for kind, vals in rows.items():
        if not vals:
            continue
        full = statistics.mean(v[0] for v in vals)
        sent = statistics.mean(v[1] for v in vals)
        print(f"{kind:8s} {len(vals):5d} {full:18,.0f} {sent:12,.0f} {sent / args.batch:10,.1f} "
              f"{full / sent:6.1f}x")
    last_full, last_sent = rows["decode"][-1]
    print(f"last decode step (context {args.context}): full batch {last_full:,} B, sent "
          f"{last_sent:,} B")


if __name__ == "__main__":
    main()
