"""`pagedllm bench`: offline throughput of this engine on random prompts (no peers; see
benchmarks/throughput.py for the side-by-side comparison with HF transformers and vLLM)."""
from __future__ import annotations

import argparse
import random
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("bench", help="offline throughput on random prompts")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--warmup-prompts", type=int, default=4)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    vocab = llm.llm_engine.config.model.get_vocab_size()
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: args.warmup_prompts], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests in {elapsed:.2f} s: {len(outs) / elapsed:.2f} req/s, "
          f"{generated / elapsed:.1f} output tok/s, "
          f"{(generated + args.input_len * len(outs)) / elapsed:.1f} total tok/s")
    return 0
