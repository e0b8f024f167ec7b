"""Offline throughput of pagedllm vs Hugging Face transformers vs vLLM (like vLLM's
benchmark_throughput): the same seeded random token-id prompts, greedy, ignore_eos.

    python benchmarks/throughput.py [--model PATH] --input-len 32 --output-len 64 \\
        --num-prompts 64 --dtype float32 --backend pagedllm,hf,vllm

Each engine runs in its own subprocess (benchmarks/_peers.py); vLLM under --vllm-python.
--repeats N runs the engines N times round robin and reports each one's median run (for machines
whose speed drifts).
Without --model a random-weight 99M Llama (make_model.py bench99m) is built into a cache dir.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import add_report_args, check_report_args, write_report
from tqdm import tqdm

logger = logging.getLogger("throughput")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
BACKENDS = ("pagedllm", "hf", "vllm")
RATIOS = (("pagedllm", "vllm"), ("pagedllm", "hf"), ("vllm", "hf"))
DEFAULT_CACHE = Path.home() / ".cache" / "pagedllm" / "bench"


def parse_backends(values: list[str] | None) -> list[str]:
    """``--backend a --backend b,c`` -> [a, b, c] in order, without repeats; default all."""
    names = [n.strip() for v in (values or [",".join(BACKENDS)]) for n in v.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown --backend {unknown}; choose from {list(BACKENDS)}")
    return list(dict.fromkeys(names))


def default_model(seed: int) -> Path:
    """The bench99m float32 checkpoint for ``seed``, built once into the cache dir."""
    out = Path(os.environ.get("PAGEDLLM_BENCH_CACHE", DEFAULT_CACHE)) / f"bench99m-seed{seed}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    logger.info("building bench99m (seed %d) into %s", seed, out)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, str(BENCH_DIR / "make_model.py"), str(tmp), "--preset",
                    "bench99m", "--seed", str(seed)], check=True)
    tmp.rename(out)
    return out


def load_model_config(model: Path) -> dict[str, Any]:
    with open(model / "config.json") as f:
        return json.load(f)


def special_ids(model: Path, config: dict[str, Any]) -> set[int]:
    """bos/eos/pad ids from config.json plus every added (special) token in tokenizer.json."""
    ids = {config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    flat = {i for v in ids for i in (v if isinstance(v, list) else [v]) if i is not None}
    tok = model / "tokenizer.json"
    if tok.exists():
        with open(tok) as f:
            flat |= {t["id"] for t in json.load(f).get("added_tokens", [])}
    return flat


def make_prompts(n: int, length: int, vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` uniform random token ids in [0, vocab) minus ``avoid``."""
    allowed = [i for i in range(vocab) if i not in avoid]
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


def flops_per_token(config: dict[str, Any], context: float) -> float:
    """Forward FLOPs for one token at mean attention ``context``: 2 x matmul weights + attention."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    q = heads * (config.get("head_dim") or config["hidden_size"] // heads)
    return 2.0 * weight_count(config) + 4.0 * layers * q * context  # QK^T and PV


def weight_count(config: dict[str, Any]) -> int:
    """Matmul weights one token's forward reads: the layers and the lm_head, not the embedding."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    return layers * (2 * h * q + 2 * h * kv + 3 * h * i) + v * h


def cpu_busy_seconds() -> float:
    """CPU-seconds the whole machine has been busy since boot (/proc/stat; 0.0 elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def adopt_orphans() -> None:
    """Make this process the child subreaper (Linux): a process an engine leaves behind (vLLM's
    engine core outlives its parent's wait) is reparented here, so once reaped its CPU time counts
    as the engine's in RUSAGE_CHILDREN rather than as other load."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap_orphans(timeout_s: float = 10.0) -> None:
    """Reap adopted descendants, waiting up to ``timeout_s`` for those still exiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no children left
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def run_child(name: str, python: str, spec: dict[str, Any], log_dir: Path,
              env: dict[str, str]) -> dict[str, Any]:
    """Run ``_peers.py`` for ``spec`` under ``python``; its output goes to log_dir/name.log."""
    if not Path(python).exists():
        return dict(backend=name, skipped=True, error=f"python {python!r} not found")
    spec_path, result_path = log_dir / f"{name}.spec.json", log_dir / f"{name}.result.json"
    log_path = log_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    logger.info("running %s with %s (log: %s)", name, python, log_path)
    busy, own, start = cpu_busy_seconds(), children_cpu_seconds(), time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([python, str(BENCH_DIR / "_peers.py"), str(spec_path),
                               str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO_ROOT)
    reap_orphans()
    wall = time.perf_counter() - start
    # cores kept busy by processes other than this engine (another build or test on the box)
    others = (cpu_busy_seconds() - busy - (children_cpu_seconds() - own)) / wall
    if others > 0.25:
        logger.warning("%s: other processes kept %.2f cores busy during the run; timings are "
                       "skewed", name, others)
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if proc.returncode != 0 or "error" in result:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        result.setdefault("error", f"exited with status {proc.returncode}")
        logger.warning("%s: %s\n%s", name, result["error"], tail if proc.returncode else "")
    result.update(backend=name, wall_s=wall, other_cores_busy=max(0.0, others))
    return result


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Scheduler settings given on the command line, passed to pagedllm's and vLLM's LLM alike."""
    kwargs: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enable_chunked_prefill:
        kwargs["enable_chunked_prefill"] = True
    return kwargs


def child_env(backend: str, kv_cache_gib: float) -> dict[str, str]:
    env = dict(os.environ)
    if backend == "vllm":
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # use every core
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        # hides broken torchvision/torchaudio builds in every vLLM process (_vllm_site/)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_DIR / "_vllm_site"),
                                                          env.get("PYTHONPATH")]))
    else:  # import pagedllm from this tree even when it is not pip-installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def add_metrics(result: dict[str, Any], args: argparse.Namespace, flops: float) -> None:
    """Fill requests/s, tok/s and achieved GFLOP/s from elapsed_s and the returned token ids."""
    out_tokens = sum(len(t) for t in result["token_ids"])
    expected = args.num_prompts * args.output_len
    if out_tokens != expected:
        logger.warning("%s produced %d output tokens, expected %d", result["backend"],
                       out_tokens, expected)
    in_tokens = args.num_prompts * args.input_len
    elapsed = result["elapsed_s"]
    result.update(output_tokens=out_tokens, prompt_tokens=in_tokens,
                  requests_per_s=args.num_prompts / elapsed, output_tok_per_s=out_tokens / elapsed,
                  total_tok_per_s=(in_tokens + out_tokens) / elapsed,
                  achieved_gflops=(in_tokens + out_tokens) * flops / elapsed / 1e9)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tok/s (the lower middle for an even count); the first
    failed run when none succeeded."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["output_tok_per_s"])
    return ok[(len(ok) - 1) // 2] if ok else runs[0]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Prompts whose greedy ids match exactly, and the mean length of the common prefix."""
    prefixes = []
    for x, y in zip(a, b):
        k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefixes.append(k)
    same = sum(x == y for x, y in zip(a, b))
    return dict(identical=same, prompts=len(prefixes), mean_common_prefix=sum(prefixes) / len(prefixes))


def table(results: dict[str, dict[str, Any]], peak: float | None) -> list[str]:
    """Markdown rows, one per engine; an engine that failed shows its error."""
    rows = ["| backend | version | device | elapsed s | req/s | output tok/s | total tok/s "
            "| GFLOP/s | % GEMM peak | load s | wall s | other load |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | {r['error']} |" + " |" * 10)
            continue
        pct = f"{100 * r['achieved_gflops'] / peak:.1f}" if peak else "-"
        rows.append(f"| {name} | {r['version']} | {r['device']} | {r['elapsed_s']:.2f} "
                    f"| {r['requests_per_s']:.2f} | {r['output_tok_per_s']:.1f} "
                    f"| {r['total_tok_per_s']:.1f} | {r['achieved_gflops']:.1f} | {pct} "
                    f"| {r['load_s']:.1f} | {r['wall_s']:.1f} | {r['other_cores_busy']:.2f} cores |")
    return rows


def report(results: dict[str, dict[str, Any]], gemm: dict[str, Any], flops: float,
           args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """Print the markdown table, ratios, roofline and agreement; return them for --output-json."""
    ok = {k: r for k, r in results.items() if "error" not in r}
    rates = gemm.get("gemm_gflops", {})
    peak = rates.get(args.dtype) or rates.get("float32")
    ratios = {f"{a}/{b}": ok[a]["output_tok_per_s"] / ok[b]["output_tok_per_s"]
              for a, b in RATIOS if a in ok and b in ok}
    names = list(ok)
    agree = {f"{a} vs {b}": agreement(ok[a]["token_ids"], ok[b]["token_ids"])
             for i, a in enumerate(names) for b in names[i + 1 :]}
    lines = [f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
             f"dtype {args.dtype}, model {args.model}", ""] + table(results, peak) + [""]
    lines += [f"- output-throughput ratio {k}: {v:.2f}x" for k, v in ratios.items()]
    measured = ", ".join(f"{k} {v:.1f} (n={gemm['gemm_size'][k]})" for k, v in rates.items())
    ceiling = (f" -> {args.dtype} compute ceiling {peak * 1e9 / flops:.0f} tok/s (prompt + "
               f"output)" if peak else "")
    lines.append(f"- roofline: torch.mm GFLOP/s {measured or gemm.get('error')}; "
                 f"model {flops / 1e9:.3f} GFLOP/token{ceiling}")
    if "copy_gbps" in gemm:  # every decode step streams all weights at least once
        weight_bytes = weight_count(config) * (2 if args.dtype != "float32" else 4)
        lines.append(f"- memory roofline: copy {gemm['copy_gbps'] / 1e3:.2f} TB/s, weights "
                     f"{weight_bytes / 1e9:.1f} GB -> one decode step >= "
                     f"{weight_bytes / (gemm['copy_gbps'] * 1e9) * 1e3:.2f} ms (batch 1: <= "
                     f"{gemm['copy_gbps'] * 1e9 / weight_bytes:.0f} tok/s)")
    lines += [f"- greedy ids {k}: {g['identical']}/{g['prompts']} prompts identical, mean "
              f"common prefix {g['mean_common_prefix']:.1f}/{args.output_len}"
              for k, g in agree.items()]
    print("\n" + "\n".join(lines))
    slim = {k: {f: v for f, v in r.items() if f != "token_ids"} for k, r in results.items()}
    return dict(args={k: str(v) for k, v in vars(args).items()},
                roofline=dict(gemm, model_gflop_per_token=flops / 1e9),
                results=slim, ratios=ratios, agreement=agree)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--backend", action="append", help=f"repeat or comma list of {BACKENDS}")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    p.add_argument("--hf-batch-size", type=int, default=0, help="0: all prompts in one batch")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="pagedllm's KV cache size; 0: sized by profiling (gpu_memory_utilization)")
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=256, help="pagedllm's and vLLM's batch cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="pagedllm's and vLLM's token budget per step (default: the engine's)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="pagedllm and vLLM: split prompts over steps, mixed with decodes")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the engines (round robin); the table shows each one's median")
    p.add_argument("--log-dir", type=Path, help="engine logs (default: a new temp dir)")
    add_report_args(p)  # --output-json, --plot
    args = p.parse_args(argv)
    try:
        check_report_args(args)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("input_len", "output_len", "num_prompts", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    from pagedllm.logger import configure_logging

    configure_logging()
    args = parse_args(argv)
    adopt_orphans()
    backends = parse_backends(args.backend)
    args.model = (args.model or default_model(args.seed)).resolve()
    config = load_model_config(args.model)
    prompts = make_prompts(args.num_prompts, args.input_len, config["vocab_size"],
                           special_ids(args.model, config), args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(model=str(args.model), dtype=args.dtype, device=args.device, seed=args.seed,
                load_format=args.load_format, prompts=prompts, output_len=args.output_len,
                warmup_prompts=min(args.warmup_prompts, args.num_prompts),
                hf_batch_size=args.hf_batch_size, kv_cache_gib=args.kv_cache_gib,
                max_num_seqs=args.max_num_seqs,
                engine_kwargs=engine_kwargs(args),
                gemm_dtypes=sorted({"float32", args.dtype}))
    gemm = run_child("gemm", sys.executable, dict(spec, backend="gemm", prompts=[]), log_dir,
                     child_env("gemm", args.kv_cache_gib))
    flops = flops_per_token(config, args.input_len + args.output_len / 2)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    bar = tqdm(total=args.repeats * len(backends), desc="engine runs", unit="run")
    for _ in range(args.repeats):  # round robin, so a machine whose speed drifts hits all alike
        for name in backends:
            bar.set_postfix_str(name)
            python = args.vllm_python if name == "vllm" else sys.executable
            result = run_child(name, python, dict(spec, backend=name), log_dir,
                               child_env(name, args.kv_cache_gib))
            if "error" not in result:
                add_metrics(result, args, flops)
            runs[name].append(result)
            bar.update()
    bar.close()
    results = {name: median_run(rs) for name, rs in runs.items()}
    if args.repeats > 1:
        for name, rs in runs.items():
            rates = [f"{r['output_tok_per_s']:.1f}" for r in rs if "error" not in r]
            logger.info("%s output tok/s per round: %s (table: the median)", name, ", ".join(rates))
    summary = report(results, gemm, flops, args, config)
    bars = [(name, r["output_tok_per_s"]) for name, r in results.items() if "error" not in r]
    bars.sort(key=lambda bar: bar[0] != "pagedllm")  # pagedllm first: the ratios are to it
    write_report(args, summary, bars, title=f"{args.num_prompts} x {args.input_len}/"
                 f"{args.output_len} tokens, {args.dtype}, {args.model.name}")


if __name__ == "__main__":
    main()
