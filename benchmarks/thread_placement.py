"""CPU decode speed vs OpenMP thread placement, on a quiet machine and under a background load.

    python benchmarks/thread_placement.py [--rounds 3] [--prompts 32 --input-len 300 --output-len 48]

Every (load, setting) pair runs in a fresh process of its own (OpenMP reads its environment once),
round robin over --rounds rounds, so that the settings share whatever else the machine is doing:
- load "quiet": nothing started by this script (other users' work still counts: repeat rounds);
- load "busy2": two busy-looping Python processes, pinned nowhere, run for the whole measurement;
- settings: PAGEDLLM_CPU_OMP_THREADS_BIND nobind / auto, each plain, with OMP_WAIT_POLICY=PASSIVE
  (threads sleep at once at a barrier) and with GOMP_SPINCOUNT=10000 (spin ~30x shorter than
  libgomp's default before sleeping).
A child loads the model (default: the bench99m bf16 checkpoint, benchmarks/make_model.py), warms up
on prompts of its own, prefills the timed prompts with max_tokens=1 (prefix caching on), then
times generate(max_tokens=output_len, ignore_eos) over the same prompts: their prefix is cached,
so that run is the decode steps (plus the prompts' last partial block). Reported: decode ms per
step (TPOT) min / median over rounds, its ratio to nobind in the same load, and the prefill time.
Each run's sequences are compared with the first run's (the count that differ is printed).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_MODEL = Path(os.environ.get("PAGEDLLM_BENCH_CACHE",
                                    Path.home() / ".cache" / "pagedllm" / "bench")) / "bench99m-seed0"
logger = logging.getLogger("thread_placement")

# setting name -> the environment it adds
SETTINGS: dict[str, dict[str, str]] = {
    "nobind": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "nobind"},
    "auto": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "auto"},
    "nobind+passive": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"},
    "auto+passive": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "auto", "OMP_WAIT_POLICY": "PASSIVE"},
    "nobind+spin10k": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "nobind", "GOMP_SPINCOUNT": "10000"},
    "auto+spin10k": {"PAGEDLLM_CPU_OMP_THREADS_BIND": "auto", "GOMP_SPINCOUNT": "10000"},
}
LOADS = ("quiet", "busy2")
_BUSY = "import os\nos.nice(0)\nwhile True:\n    pass\n"


def child(spec_path: Path, result_path: Path) -> None:
    """One measurement in this process (environment already set by the parent)."""
    spec = json.loads(spec_path.read_text())
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, seed=0,
              kv_cache_space_gib=2.0)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    warm = [{"prompt_token_ids": ids} for ids in spec["warmup"]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    prefill_s = time.perf_counter() - start
    n = spec["output_len"]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    decode_s = time.perf_counter() - start
    result_path.write_text(json.dumps(dict(
        prefill_s=prefill_s, decode_s=decode_s, tpot_ms=decode_s / n * 1e3,
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        affinity=sorted(os.sched_getaffinity(0)))))


def _start_load(kind: str) -> list[subprocess.Popen]:
    if kind == "quiet":
        return []
    return [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(2)]


def _stop_load(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def _run(load: str, setting: str, spec_path: Path, work: Path, index: int) -> dict[str, Any]:
    env = dict(os.environ)
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PAGEDLLM_CPU_OMP_THREADS_BIND"):
        env.pop(key, None)
    env.update(SETTINGS[setting])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result_path, log_path = work / f"{index}.json", work / f"{index}.log"
    background = _start_load(load)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path),
                                   str(result_path)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    finally:
        _stop_load(background)
    if proc.returncode != 0 or not result_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-10:])
        raise RuntimeError(f"{load}/{setting} failed (status {proc.returncode}):\n{tail}")
    return json.loads(result_path.read_text())


def _table(results: dict[tuple[str, str], list[dict[str, Any]]], settings: list[str],
           loads: list[str]) -> list[str]:
    lines = ["| load | setting | TPOT ms min | TPOT ms median | vs nobind (median) | prefill s median |",
             "| --- | --- | --- | --- | --- | --- |"]
    for load in loads:
        base = statistics.median(r["tpot_ms"] for r in results[(load, settings[0])])
        for setting in settings:
            runs = results[(load, setting)]
            tpot = [r["tpot_ms"] for r in runs]
            med = statistics.median(tpot)
            lines.append(f"| {load} | {setting} | {min(tpot):.1f} | {med:.1f} | "
                         f"{med / base:.2f}x | {statistics.median(r['prefill_s'] for r in runs):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=300)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--setting", action="append", choices=list(SETTINGS),
                   help="settings to compare (default: all; the first is the ratio's base)")
    p.add_argument("--load", action="append", choices=LOADS, help="loads (default: both)")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not (args.model / "config.json").exists():
        p.error(f"--model {args.model} has no config.json (build it: python "
                f"benchmarks/make_model.py bench99m --seed 0)")
    settings, loads = args.setting or list(SETTINGS), args.load or list(LOADS)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    draw = lambda n: [[rng.randrange(3, vocab) for _ in range(args.input_len)]  # noqa: E731
                      for _ in range(n)]
    spec = dict(model=str(args.model), dtype=args.dtype, output_len=args.output_len,
                prompts=draw(args.prompts), warmup=draw(4))
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(l, s): [] for l in loads for s in settings}
    reference: list[list[int]] | None = None
    with tempfile.TemporaryDirectory(prefix="thread_placement-") as tmp:
        work = Path(tmp)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        index = 0
        for rnd in range(args.rounds):
            for load in loads:
                # rotated each round: no setting always runs first after a load change
                for setting in settings[rnd % len(settings):] + settings[:rnd % len(settings)]:
                    run = _run(load, setting, spec_path, work, index)
                    index += 1
                    if reference is None:
                        reference = run["tokens"]
                    run["differing"] = sum(a != b for a, b in zip(run.pop("tokens"), reference))
                    results[(load, setting)].append(run)
                    logger.info("round %d %s %s: TPOT %.1f ms, prefill %.2f s, %d sequences "
                                "differ from the first run's", rnd, load, setting, run["tpot_ms"],
                                run["prefill_s"], run["differing"])
    print("\n".join(_table(results, settings, loads)))
    differing = sum(r["differing"] for runs in results.values() for r in runs)
    print(f"\n{args.prompts} prompts x {args.input_len} in / {args.output_len} out, {args.dtype}, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs; sequences differing from the first "
          f"run's, over all runs: {differing}")
    if args.json:
        args.json.write_text(json.dumps({f"{l}/{s}": r for (l, s), r in results.items()}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
