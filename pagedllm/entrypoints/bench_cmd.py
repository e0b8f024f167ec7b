"""`pagedllm bench`: offline throughput of this engine on random prompts, optionally side by side
with Hugging Face transformers' ``generate`` on the same prompts (``--peer hf``), with a progress
bar, ``--output-json PATH`` and ``--plot out.png``. benchmarks/throughput.py is the full
comparison (vLLM too, each engine in its own process, repeats).

    pagedllm bench --model PATH --num-prompts 64 --input-len 32 --output-len 64 \\
        --peer hf --output-json bench.json --plot bench.png
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from typing import Any

from pagedllm.entrypoints.bench_report import add_report_args, check_report_args, write_report

logger = logging.getLogger(__name__)

PEERS = ("none", "hf")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("bench", help="offline throughput on random prompts (optionally vs HF)",
                       description=__doc__.split("\n\n")[0])
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    bench.add_argument("--output-len", type=int, default=64,
                       help="generated tokens per prompt, EOS ignored (default 64)")
    bench.add_argument("--num-prompts", type=int, default=64, help="prompts (default 64)")
    bench.add_argument("--warmup-prompts", type=int, default=4,
                       help="prompts run once before the timed run (default 4)")
    bench.add_argument("--peer", choices=PEERS, default="none",
                       help="also time this engine on the same prompts: hf = transformers' "
                            "generate, greedy (default none)")
    bench.add_argument("--hf-batch-size", type=int, default=0,
                       help="the HF peer's batch size; 0: all prompts in one batch (default 0)")
    add_report_args(bench)
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_prompts", "hf_batch_size"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    check_report_args(args)


def run_pagedllm(args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]], Any]:
    """The timed run: (figures, the prompts, the engine's config)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    config = llm.llm_engine.config
    vocab = config.model.get_vocab_size()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if args.warmup_prompts:
        llm.generate(inputs[: args.warmup_prompts], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=True)  # tqdm: one tick per finished prompt
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    figures = _figures(len(outs), generated, args.input_len, elapsed)
    kv = llm.llm_engine.kv
    if kv is not None:  # KV offload tiers / connectors: prefix hit rates per tier
        print(kv.summary())
        figures["kv_hit_rates"] = kv.hit_rates()
    return figures, prompts, config


def run_hf(args: argparse.Namespace, prompts: list[list[int]], config: Any) -> dict[str, Any]:
    """transformers' generate on the same prompt ids, greedy, exactly ``output_len`` new tokens."""
    import torch
    import transformers
    from tqdm import tqdm

    device = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda"}.get(config.device)
    if device is None:
        raise ValueError(f"--peer hf runs on cpu, cuda or rocm, not on device={config.device!r}")
    dtype = getattr(torch, config.model.dtype) if config.model.dtype != "auto" else "auto"
    if config.model.load_format == "dummy":  # random weights, as the engine's (no files needed)
        torch.manual_seed(args.seed)
        model = transformers.AutoModelForCausalLM.from_config(config.model.hf_config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            config.model.model, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    size = args.hf_batch_size or len(prompts)
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  do_sample=False, pad_token_id=0)

    def generate(batch: list[list[int]]) -> int:
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    if args.warmup_prompts:
        generate(prompts[: min(args.warmup_prompts, size)])
    start, generated = time.perf_counter(), 0
    for i in tqdm(range(0, len(prompts), size), desc="hf generate", unit="batch"):
        generated += generate(prompts[i:i + size])
    elapsed = time.perf_counter() - start
    return _figures(len(prompts), generated, args.input_len, elapsed)


def _figures(requests: int, generated: int, input_len: int, elapsed: float) -> dict[str, Any]:
    return {"requests": requests, "output_tokens": generated, "elapsed_s": round(elapsed, 4),
            "requests_per_s": requests / elapsed, "output_tok_s": generated / elapsed,
            "total_tok_s": (generated + input_len * requests) / elapsed}


def run(args: argparse.Namespace) -> int:
    check_args(args)
    results: dict[str, Any] = {}
    results["pagedllm"], prompts, config = run_pagedllm(args)
    if args.peer == "hf":
        results["hf"] = run_hf(args, prompts, config)
    for name, r in results.items():
        print(f"{name}: {r['requests']} requests in {r['elapsed_s']:.2f} s: "
              f"{r['requests_per_s']:.2f} req/s, {r['output_tok_s']:.1f} output tok/s, "
              f"{r['total_tok_s']:.1f} total tok/s")
    ratios = {f"pagedllm/{name}": results["pagedllm"]["output_tok_s"] / r["output_tok_s"]
              for name, r in results.items() if name != "pagedllm"}
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    workload = {"model": config.model.model, "device": config.device, "dtype": config.model.dtype,
                "num_prompts": args.num_prompts, "input_len": args.input_len,
                "output_len": args.output_len, "seed": args.seed}
    write_report(args, {"workload": workload, "results": results, "ratios": ratios},
                 [(name, r["output_tok_s"]) for name, r in results.items()],
                 title=f"{args.num_prompts} x {args.input_len}/{args.output_len} tokens, "
                       f"{config.model.dtype} on {config.device}")
    return 0
