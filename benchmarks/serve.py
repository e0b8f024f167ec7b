"""Online serving benchmark (like vLLM's benchmark_serving): TTFT, TPOT, ITL and throughput.

Drive a running server:

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 128 \\
        --random-input-len 32 --random-output-len 64 --max-concurrency 32

or start one (and compare with offline ``pagedllm.LLM`` on the same prompts, in its own process):

    python benchmarks/serve.py --launch [MODEL] --device cpu --dtype float32 --max-concurrency 32

Requests are streamed ``/v1/completions`` calls (greedy, ``ignore_eos``, exactly the output length)
sent with Poisson arrivals at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight. Without a model path, ``--launch`` builds the random-weight
bench99m Llama (make_model.py) into the benchmark cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("serve-bench")
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between token chunks
    output_tokens: int = 0
    error: str = ""


# --- prompts -------------------------------------------------------------------------------
def load_dataset(args: argparse.Namespace, model_path: Path | None) -> list[tuple[Any, int]]:
    """(prompt, output_len) pairs: random token ids, or a JSONL/JSON file of prompts."""
    if args.dataset != "random":
        text = Path(args.dataset).read_text()
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
        pairs = []
        for row in rows[: args.num_prompts]:
            row = {"prompt": row} if isinstance(row, str) else row
            pairs.append((row["prompt"], int(row.get("output_len", args.random_output_len))))
        return pairs
    rng = random.Random(args.seed)
    if model_path is not None and (model_path / "config.json").exists():
        vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
        avoid = special_ids(model_path)
        allowed = [i for i in range(vocab) if i not in avoid]
        return [([rng.choice(allowed) for _ in range(args.random_input_len)],
                 args.random_output_len) for _ in range(args.num_prompts)]
    logger.warning("model folder unknown: random prompts are words, about one token each")
    return [(" ".join(f"w{rng.randrange(1000)}" for _ in range(args.random_input_len)),
             args.random_output_len) for _ in range(args.num_prompts)]


def special_ids(model: Path) -> set[int]:
    config = json.loads((model / "config.json").read_text())
    ids = {config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    flat = {i for v in ids for i in (v if isinstance(v, list) else [v]) if i is not None}
    tok = model / "tokenizer.json"
    if tok.exists():
        flat |= {t["id"] for t in json.loads(tok.read_text()).get("added_tokens", [])}
    return flat


# --- the client ------------------------------------------------------------------------------
async def one_request(client: Any, url: str, model: str, prompt: Any, output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices"):
                    if "error" in data:
                        res.error = data["error"]["message"]
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = not res.error
    except Exception as exc:  # noqa: BLE001 - reported per request
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(base_url: str, model: str, pairs: list[tuple[Any, int]], rate: float,
                   max_concurrency: int | None, seed: int) -> tuple[list[Result], float]:
    import httpx

    limit = max_concurrency or len(pairs)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def limited(prompt: Any, n: int) -> Result:
            async with sem:
                return await one_request(client, url, model, prompt, n)

        start = time.perf_counter()
        tasks = []
        for prompt, n in pairs:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def warm_and_run(base_url: str, model: str, pairs: list[tuple[Any, int]],
                 warmup: list[tuple[Any, int]], rate: float, max_concurrency: int | None,
                 seed: int) -> tuple[list[Result], float]:
    """The warm-up (prompt, output_len) pairs all at once (untimed), then run_load of ``pairs``:
    (results, seconds the timed load took)."""
    if warmup:
        asyncio.run(run_load(base_url, model, warmup, float("inf"), None, seed))
    return asyncio.run(run_load(base_url, model, pairs, rate, max_concurrency, seed))


def summarize(results: list[Result], duration: float, pairs: list[tuple[Any, int]]
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "median": 0.0, "p99": 0.0}
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
        return {"mean": statistics.fmean(values) * ms, "median": statistics.median(values) * ms,
                "p99": p99 * ms}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    expected = sum(n for (_, n), r in zip(pairs, results) if r.ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "duration_s": duration, "output_tokens": out_tokens,
            "output_tokens_expected": expected,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
            "itl_ms": stats([g for r in ok for g in r.itl]),
            "e2e_ms": stats([r.latency for r in ok])}


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"\n{'=' * 14} {title} {'=' * 14}")
    print(f"{'Successful requests:':<36}{s['completed']:>10}")
    print(f"{'Failed requests:':<36}{s['failed']:>10}")
    for err in s["errors"]:
        print(f"  error: {err}")
    print(f"{'Benchmark duration (s):':<36}{s['duration_s']:>10.2f}")
    print(f"{'Total generated tokens:':<36}{s['output_tokens']:>10}")
    print(f"{'Request throughput (req/s):':<36}{s['request_throughput']:>10.2f}")
    print(f"{'Output token throughput (tok/s):':<36}{s['output_throughput']:>10.2f}")
    for key, name, short in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"),
                             ("e2e_ms", "End-to-end Latency", "E2EL")):
        print(f"{'-' * 10} {name} {'-' * 10}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {short} (ms):':<36}{s[key][stat]:>10.2f}")


# --- launching a server, and the offline baseline ------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
             "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_space_gib:
        flags += ["--kv-cache-space-gib", str(args.kv_cache_space_gib)]
    return flags


def start_server(cmd: list[str], env: dict[str, str], log_path: Path, base_url: str,
                 timeout_s: float, name: str = "server", cwd: Path | None = None) -> Any:
    """Popen ``cmd`` (stdout and stderr to log_path) and wait until base_url/health answers 200;
    the process. RuntimeError naming ``name`` and the log when it exits or timeout_s passes
    first (then it is killed)."""
    import httpx

    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{name} did not become healthy in {timeout_s:.0f} s; see {log_path}")


def launch_server(args: argparse.Namespace, model: Path, log_path: Path) -> tuple[Any, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", str(model),
           "--port", str(port), "--served-model-name", "bench", "--disable-log-requests",
           "--disable-uvicorn-access-log", *engine_flags(args), *args.server_arg]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if args.server_threads:
        env["OMP_NUM_THREADS"] = str(args.server_threads)
    base = f"http://127.0.0.1:{port}"
    try:
        return start_server(cmd, env, log_path, base, 300), base
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def stop_server(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_offline(args: argparse.Namespace, model: Path, pairs: list[tuple[Any, int]],
                workdir: Path) -> dict[str, Any]:
    """The same prompts through pagedllm.LLM in a fresh process (max_num_seqs = concurrency)."""
    spec = {"model": str(model), "device": args.device, "dtype": args.dtype, "seed": args.seed,
            "max_num_seqs": args.offline_max_num_seqs or args.max_concurrency or args.max_num_seqs,
            "kv_cache_space_gib": args.kv_cache_space_gib, "pairs": pairs,
            "warmup": args.warmup_requests}
    spec_path, result_path = workdir / "offline.spec.json", workdir / "offline.result.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / "offline.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--offline-worker", str(spec_path),
                        str(result_path)], stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads(result_path.read_text())


def offline_worker(spec_path: str, result_path: str) -> None:
    from pagedllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], device=spec["device"], dtype=spec["dtype"], seed=spec["seed"],
              max_num_seqs=spec["max_num_seqs"], kv_cache_space_gib=spec["kv_cache_space_gib"])
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p, _ in spec["pairs"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for _, n in spec["pairs"]]
    k = spec["warmup"]
    if k:
        llm.generate(prompts[:k], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
                     * k, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(result_path).write_text(json.dumps({
        "elapsed_s": elapsed, "output_tokens": tokens, "output_throughput": tokens / elapsed,
        "request_throughput": len(outs) / elapsed, "max_num_seqs": spec["max_num_seqs"]}))


# --- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="model name sent in requests (default: the server's first)")
    p.add_argument("--model-path", type=Path, help="checkpoint folder, for random token ids")
    p.add_argument("--dataset", default="random", help="'random' or a JSON/JSONL file of prompts")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--launch", nargs="?", const="", default=None, metavar="MODEL",
                   help="start a server on MODEL (default: bench99m) and compare with offline")
    p.add_argument("--no-offline", action="store_true", help="with --launch: skip the offline run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--offline-max-num-seqs", type=int, default=None,
                   help="offline batch limit (default: --max-concurrency, so batches match)")
    p.add_argument("--kv-cache-space-gib", type=float, default=4.0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for the launched server (repeatable), e.g. "
                        "--server-arg=--disable-frontend-multiprocessing")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the launched server (default: torch's choice)")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    for name in ("random_input_len", "random_output_len", "num_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def resolve_launch_model(args: argparse.Namespace) -> Path:
    if args.launch:
        return Path(args.launch).resolve()
    sys.path.insert(0, str(BENCH_DIR))
    from throughput import default_model  # the cached bench99m checkpoint

    return default_model(args.seed)


def server_model(base_url: str) -> tuple[str, Path | None]:
    import httpx

    card = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]
    root = Path(card["root"]) if card.get("root") else None
    return card["id"], root if root is not None and root.is_dir() else None


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--offline-worker":
        offline_worker(sys.argv[2], sys.argv[3])
        return
    logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",  # pagedllm.logger's
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-serve-bench-"))
    proc = None
    if args.launch is not None:
        model_path = resolve_launch_model(args)
        logger.info("launching a server on %s (log: %s)", model_path, workdir / "server.log")
        proc, base_url = launch_server(args, model_path, workdir / "server.log")
    else:
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        model_path = args.model_path
    try:
        name, root = server_model(base_url)
        model_path = model_path or root
        pairs = load_dataset(args, model_path)
        model = args.model or name
        logger.info("%d requests, rate %s, max concurrency %s", len(pairs), args.request_rate,
                    args.max_concurrency)
        results, duration = warm_and_run(base_url, model, pairs,
                                         [(p, 8) for p, _ in pairs[: args.warmup_requests]],
                                         args.request_rate, args.max_concurrency, args.seed)
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(results, duration, pairs)
    summary["config"] = {k: str(v) for k, v in vars(args).items()}
    print_summary("Serving Benchmark Result", summary)
    if summary["output_tokens"] != summary["output_tokens_expected"]:
        print(f"WARNING: {summary['output_tokens']} output tokens, expected "
              f"{summary['output_tokens_expected']}")
    if proc is not None and not args.no_offline:
        logger.info("offline run (log: %s)", workdir / "offline.log")
        offline = run_offline(args, model_path, pairs, workdir)
        summary["offline"] = offline
        ratio = summary["output_throughput"] / offline["output_throughput"]
        summary["serving_over_offline"] = ratio
        print(f"\n{'=' * 14} Offline (pagedllm.LLM, max_num_seqs={offline['max_num_seqs']}) "
              f"{'=' * 14}")
        print(f"{'Duration (s):':<36}{offline['elapsed_s']:>10.2f}")
        print(f"{'Output token throughput (tok/s):':<36}{offline['output_throughput']:>10.2f}")
        print(f"{'Serving / offline throughput:':<36}{ratio:>10.3f}")
    if args.output_json:
        args.output_json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
