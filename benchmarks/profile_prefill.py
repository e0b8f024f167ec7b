"""Where a prefill-bound run's time goes: torch.profiler's per-op table over workloads.py's
"prefill" workload (128 prompts of ShareGPT-like lengths, 8-384 tokens, 1 token out).

    python benchmarks/profile_prefill.py --dtype bfloat16 [--model PATH] [--rows 15]

Prints the wall time of one untimed-profiler run, then the profiled run's op table (self CPU
time: the GEMMs are mkldnn::_linear_pointwise, the attention pagedllm_cpu::paged_attention_*).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput as tp  # noqa: E402
from workloads import make_workload  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("profile_prefill")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="prefill")
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args()
    model = (args.model or tp.default_model(0)).resolve()
    config = tp.load_model_config(model)
    avoid = tp.special_ids(model, config)
    vocab = [i for i in range(config["vocab_size"]) if i not in avoid]
    prompts, outs = make_workload(args.workload, vocab, 0)
    warm, warm_outs = make_workload(args.workload, vocab, 0, warmup=True)
    llm = LLM(str(model), device="cpu", dtype=args.dtype, enable_prefix_caching=True)

    def run(ps: list[list[int]], lens: list[int]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": q} for q in ps], params, use_tqdm=False)
        return time.perf_counter() - start

    run(warm, warm_outs)
    logger.info("%s %s: %d prompts, %d prompt tokens: %.2f s", args.workload, args.dtype,
                len(prompts), sum(map(len, prompts)), run(prompts, outs))
    others, other_outs = make_workload(args.workload, vocab, 1)  # no prefix-cache hits
    with torch.profiler.profile() as prof:
        elapsed = run(others, other_outs)
    logger.info("profiled run (another seed's prompts): %.2f s", elapsed)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
