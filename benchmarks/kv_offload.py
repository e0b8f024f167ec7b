"""KV offload tiers and disaggregated prefill (issue 45): documents asked again after the device
cache has evicted them, with the host tier, with the disk tier and with neither (recompute);
then a producer + consumer + proxy against a single instance on the variable-length workload.

    # cpu (the recorded run; 99M Llama bench99m, bf16, the disk tier on the local disk): the
    # defaults, 16 documents of 512 tokens, the device holds 2 (the issue's 8 : 64), 32 requests
    # of the variable workload; 10-16 minutes on 2 busy Zen 1 cores (bf16 prefill ~165 tok/s)
    python benchmarks/kv_offload.py --dtype bfloat16
    # the issue's sizes: 64 documents of ~4k tokens, 4 questions each, the device holds 8
    # (two calls, each under 10 minutes: the offload configurations, then single vs disagg)
    python benchmarks/make_model.py /tmp/l3 --preset llama3-8b-shape
    python benchmarks/kv_offload.py --device cuda --model /tmp/l3 --docs 64 --doc-tokens 4096 \\
        --device-docs 8 --disagg-requests 0
    python benchmarks/kv_offload.py --device cuda --model /tmp/l3 --config single \\
        --config disagg --disagg-requests 128

Offload workload: ``--docs`` documents of ``--doc-tokens`` random token ids, each asked
``--questions`` questions (``--question-tokens`` ids of its own after the document), every
(document, question) request in one seeded shuffled order, greedy, ``--output-tokens`` tokens
out (ignore_eos). Prefix caching is on everywhere; the device cache is ``num_gpu_blocks_override``
blocks, enough for ``--device-docs`` requests (on cpu the "device" is host memory too), so a
document is mostly evicted before it is asked again. Configurations, each in a fresh process
(this file with --child): ``recompute`` (no tier: an evicted document is computed again),
``host`` (kv_offload_size sized to hold every block of the run) and ``disk`` (only a disk tier
of that size, kv_offload_disk in --disk-dir; default a folder beside the model cache, on the
local disk, not tmpfs) and ``device`` (no tier, a device cache that holds every block: the
documents asked again are ordinary prefix hits). Each is warmed up with other documents (each
asked twice, the second pass coming from its tier), then runs the requests one at a time in the
shuffled order:
TTFT of a request = the wall time from LLMEngine.add_request to the end of the engine step that
returns its first output token (nothing else is queued, so it is the prefill or the tier load
plus the question's prefill, and one sampling step); throughput = requests (and prompt + output
tokens) / the wall time of the whole sequence. The table gives p50/p99 TTFT, the throughput,
their ratios to recompute, the prefix hits per tier (engine stats: the fraction of the prompts'
full blocks found on the device and loaded from each tier) and whether greedy ids equal
recompute's and the device hits' (a difference fails the run, exit status 1). With ``device`` in
the run, a tier is held to the device hits' ids: a loaded prefix is the same computation as a
prefix hit, while recomputing a prompt runs other kernels (in bf16 a near-tie may flip), so then
only the tiers' difference from ``device`` fails the run.

Disaggregated workload: workloads.py's ``variable`` (ShareGPT-like lengths; --disagg-requests of
them) sent at once as streamed /v1/completions to ``single`` (one `pagedllm serve`) and to
``disagg`` (`pagedllm serve` kv_producer + `pagedllm serve` kv_consumer, SharedStorageConnector
over a /dev/shm folder, and `pagedllm proxy` in front); TTFT there is the client's (request sent
-> first streamed token, through the proxy: the producer's prefill + the consumer's load). On cpu
the producer and the consumer get half of the cores each (OMP_NUM_THREADS), the single instance
all; on cuda both share the one GPU (--gpu-memory-utilization 0.4 each). Texts must be equal.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
OFFLOAD_CONFIGS = ("recompute", "host", "disk", "device")
DISAGG_CONFIGS = ("single", "disagg")
BLOCK_SIZE = 16
logger = logging.getLogger("kv_offload_bench")


# --- the child: one engine, one configuration of the offload workload -----------------------
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(spec["tiers"])
    if spec["load_format"] != "auto":
        kwargs["load_format"] = spec["load_format"]
    start = time.perf_counter()
    llm = LLM(spec["model"], device=spec["device"], dtype=spec["dtype"], seed=0,
              block_size=BLOCK_SIZE, num_gpu_blocks_override=spec["device_blocks"],
              enable_prefix_caching=True, max_model_len=spec["max_model_len"], **kwargs)
    load_s = time.perf_counter() - start
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)

    def one(request_id: str, prompt: list[int]) -> tuple[float, list[int]]:
        """(TTFT seconds, output ids) of ``prompt`` alone in the engine."""
        t0 = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        ttft, ids = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if ttft is None and out.outputs and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if out.finished:
                    ids = list(out.outputs[0].token_ids)
        assert ttft is not None and len(ids) == spec["output_tokens"], (request_id, ids)
        return ttft, ids

    start = time.perf_counter()
    for i, prompt in enumerate(spec["warmup"]):
        one(f"warm{i}", prompt)
    warmup_s = time.perf_counter() - start
    hits0 = engine.block_manager.num_prefix_hit_blocks
    kv0 = _kv_counters(engine)
    ttfts, token_ids, sources = [], [], []
    trace = _Trace(spec.get("profile"), spec["device"], len(spec["prompts"]))
    start = time.perf_counter()
    for i, prompt in enumerate(spec["prompts"]):
        trace.before(i)
        before = (engine.block_manager.num_prefix_hit_blocks, _kv_counters(engine))
        ttft, ids = one(f"req{i}", prompt)
        trace.after(i)
        ttfts.append(ttft)
        token_ids.append(ids)
        sources.append(_source(before, engine))
    elapsed = time.perf_counter() - start
    kv1 = _kv_counters(engine)
    full = sum(len(p) // BLOCK_SIZE for p in spec["prompts"])
    loaded = {k[7:]: v - kv0.get(k, 0) for k, v in kv1.items() if k.startswith("loaded:")}
    hit_blocks = engine.block_manager.num_prefix_hit_blocks - hits0
    hits = dict(device=(hit_blocks - sum(loaded.values())) / full,
                **{k: v / full for k, v in loaded.items()})
    failed = {k: v - kv0.get(k, 0) for k, v in kv1.items() if k.startswith("failed:")}
    idle = engine.kv.check_idle() if engine.kv is not None else []
    stats = engine.stats().kv_transfer
    engine.shutdown()
    return dict(elapsed_s=elapsed, load_s=load_s, warmup_s=warmup_s, ttft_s=ttfts,
                token_ids=token_ids, sources=sources, hits=hits, failed=failed, idle_problems=idle,
                tiers=(stats or {}).get("OffloadingConnector"))


def _kv_counters(engine: Any) -> dict[str, int]:
    return dict(engine.kv.stats()["counters"]) if engine.kv is not None else {}


def _source(before: tuple[int, dict[str, int]], engine: Any) -> str:
    """Where a request's prefix came from: the tier it loaded blocks from ("host", "disk"),
    "device" (prefix hits only), or "miss" (computed)."""
    hits0, kv0 = before
    loaded = {k[7:] for k, v in _kv_counters(engine).items()
              if k.startswith("loaded:") and v > kv0.get(k, 0)}
    if loaded:
        return "+".join(sorted(loaded))
    return "device" if engine.block_manager.num_prefix_hit_blocks > hits0 else "miss"


class _Trace:
    """A torch profiler trace of ``count`` timed requests from the middle of the run (``spec
    ["profile"]`` = [folder, name, count]): a chrome trace and a table of ops there."""

    def __init__(self, profile: list | None, device: str, n: int) -> None:
        self.profile, self.device = profile, device
        self.first = n // 2
        self.prof: Any = None

    def before(self, i: int) -> None:
        if self.profile and i == self.first:
            import _profile

            self.prof = _profile.start(self.device)

    def after(self, i: int) -> None:
        if self.prof is None or i != self.first + int(self.profile[2]) - 1:
            return
        import _profile

        _profile.save(self.prof, self.profile[0], self.profile[1], self.device)
        self.prof = None


# --- the driver: the offload workload ---------------------------------------------------------
def make_offload_workload(vocab: list[int], args: argparse.Namespace
                          ) -> tuple[list[list[int]], list[list[int]]]:
    """(timed prompts in shuffled order, warm-up prompts): documents + questions of their own."""
    rng = random.Random(f"kv-offload-{args.seed}")
    tokens = lambda n: [rng.choice(vocab) for _ in range(n)]  # noqa: E731
    docs = [tokens(args.doc_tokens) for _ in range(args.docs)]
    prompts = [d + tokens(args.question_tokens) for d in docs for _ in range(args.questions)]
    rng.shuffle(prompts)
    warm_docs = [tokens(args.doc_tokens) for _ in range(min(3, args.device_docs + 1))]
    warm = [d + tokens(args.question_tokens) for _ in range(2) for d in warm_docs]
    return prompts, warm


def block_row_bytes(config: dict[str, Any], dtype: str) -> int:
    """Bytes of one KV block of every layer (the unit a tier stores)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim
    return per_token * BLOCK_SIZE * (4 if dtype == "float32" else 2)


def offload_specs(args: argparse.Namespace, config: dict[str, Any], prompts: list[list[int]],
                  warm: list[list[int]]) -> dict[str, dict[str, Any]]:
    request_len = args.doc_tokens + args.question_tokens + args.output_tokens
    per_request = math.ceil(request_len / BLOCK_SIZE)
    # every distinct block the run creates (each document once, each request's question and
    # output blocks), a quarter more: the tiers never have to drop one
    docs = args.docs + len(warm) // 2
    own = math.ceil((args.question_tokens + args.output_tokens) / BLOCK_SIZE) + 1
    tier_blocks = math.ceil(1.25 * (docs * math.ceil(args.doc_tokens / BLOCK_SIZE)
                                    + (len(prompts) + len(warm)) * own))
    tier_gib = tier_blocks * block_row_bytes(config, args.dtype) / (1 << 30)
    disk_dir = args.disk_dir or (Path(os.environ.get("PAGEDLLM_BENCH_CACHE", Path.home() / ".cache"
                                                    / "pagedllm" / "bench")) / "kv-offload-disk")
    base = dict(model=str(args.model), device=args.device, dtype=args.dtype,
                load_format=args.load_format, device_blocks=args.device_docs * per_request + 1,
                max_model_len=request_len, output_tokens=args.output_tokens, prompts=prompts,
                warmup=warm)
    tiers = dict(recompute={}, host=dict(kv_offload_size=tier_gib),
                 disk=dict(kv_offload_disk=str(disk_dir), kv_offload_disk_size=tier_gib),
                 device={})
    specs = {name: dict(base, tiers=tiers[name]) for name in args.config if name in tiers}
    if args.profile_dir:
        for name, spec in specs.items():
            spec["profile"] = [str(args.profile_dir), name, args.profile_requests]
    if "device" in specs:  # no tier, a device cache that holds every block of the run
        specs["device"]["device_blocks"] = tier_blocks + per_request
    return specs


def run_offload(name: str, spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    import throughput as tp

    spec_path, result_path = log_dir / f"{name}.spec.json", log_dir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    log_path = log_dir / f"{name}.log"
    logger.info("running %s (log: %s)", name, log_path)
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path),
                               str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=tp.child_env("pagedllm", 0), cwd=str(BENCH_DIR.parent))
    if proc.returncode != 0 or not result_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        logger.warning("%s failed (status %d):\n%s", name, proc.returncode, tail)
        return dict(error=f"exited with status {proc.returncode} (log {log_path})")
    return json.loads(result_path.read_text())


def copy_limit(nbytes: int) -> str:
    """The machine's limit for a tier hit on cuda: a pinned host -> device copy of ``nbytes``
    (one document's KV), the best of 6, measured after the configurations ran."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return (f"machine limit: a pinned host -> device copy of one document's KV ({nbytes / 1e6:.0f}"
            f" MB) takes {best * 1e3:.1f} ms ({nbytes / best / 1e9:.1f} GB/s)")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def offload_table(results: dict[str, dict[str, Any]], tokens: int) -> tuple[list[str], bool]:
    """Markdown rows and whether the greedy ids agree (see the module's docstring)."""
    lines = ["| config | TTFT p50 ms | TTFT p99 ms | req/s | tok/s (prompt + out) | TTFT p50 "
             "vs recompute | throughput vs recompute | prefix hits (of full prompt blocks) | "
             "greedy ids = recompute | greedy ids = device |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    ref = results.get("recompute", {})
    hit = results.get("device", {})
    same_all = True
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |" + " |" * 8)
            same_all = False
            continue
        p50, p99 = pct(r["ttft_s"], 0.5) * 1e3, pct(r["ttft_s"], 0.99) * 1e3
        n = len(r["ttft_s"])
        rate = n / r["elapsed_s"]
        speed = lower = same = ""
        if "ttft_s" in ref:
            lower = f"{pct(ref['ttft_s'], 0.5) * 1e3 / p50:.2f}x"
            lower += " lower" if name != "recompute" else ""
            speed = f"{ref['elapsed_s'] / r['elapsed_s']:.2f}x"
            agree = sum(a == b for a, b in zip(r["token_ids"], ref["token_ids"]))
            same = f"{agree}/{n}"
            same_all &= agree == n or "token_ids" in hit
        same_hit = ""
        if "token_ids" in hit:  # prefix hits on the device: the same computation as a tier's
            agree = sum(a == b for a, b in zip(r["token_ids"], hit["token_ids"]))
            same_hit = f"{agree}/{n}"
            same_all &= agree == n or name == "recompute"
        hits = ", ".join(f"{k} {v:.1%}" for k, v in r["hits"].items())
        if any(r["failed"].values()):
            hits += f"; failed loads {r['failed']}"
        lines.append(f"| {name} | {p50:.1f} | {p99:.1f} | {rate:.2f} | "
                     f"{tokens / r['elapsed_s']:.1f} | {lower} | {speed} | {hits} | {same} | "
                     f"{same_hit} |")
    return lines + [""] + source_lines(results), same_all


def source_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """TTFT p50 per configuration by where each request's prefix came from."""
    lines = []
    for name, r in results.items():
        by: dict[str, list[float]] = {}
        for src, t in zip(r.get("sources", []), r.get("ttft_s", [])):
            by.setdefault(src, []).append(t)
        if by:
            lines.append(f"{name}: TTFT p50 by prefix source: " + ", ".join(
                f"{src} {pct(ts, 0.5) * 1e3:.1f} ms ({len(ts)})" for src, ts in sorted(by.items())))
    return lines


# --- the driver: disaggregated vs single instance ---------------------------------------------
async def _stream(client: Any, url: str, prompt: list[int], n: int) -> tuple[float, str, str]:
    """(TTFT s, text, error) of one streamed greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start, ttft, text = time.perf_counter(), 0.0, []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return 0.0, "", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text") is not None:
                    ttft = ttft or time.perf_counter() - start
                    text.append(choices[0]["text"])
    except Exception as exc:  # noqa: BLE001 - reported per request
        return 0.0, "", f"{type(exc).__name__}: {exc}"
    return ttft, "".join(text), ""


async def _load(base: str, pairs: list[tuple[list[int], int]]) -> tuple[list[Any], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(pairs), max_keepalive_connections=len(pairs))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        out = await asyncio.gather(*(_stream(client, f"{base}/v1/completions", p, n)
                                     for p, n in pairs))
    return list(out), time.perf_counter() - start


def run_serving(name: str, args: argparse.Namespace, pairs: list[tuple[list[int], int]],
                warm: list[tuple[list[int], int]], log_dir: Path) -> dict[str, Any]:
    import serve
    import throughput as tp

    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    flags = ["--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
             "--served-model-name", "bench", "--enable-prefix-caching", "--max-num-seqs", "256",
             "--disable-log-requests", "--disable-uvicorn-access-log", "--load-format",
             args.load_format]
    env = tp.child_env("pagedllm", 0)
    procs, shared = [], tempfile.mkdtemp(prefix="pagedllm-kv-", dir="/dev/shm")
    if args.device == "cpu":
        flags += ["--kv-cache-space-gib", "2"]
    try:
        def start(role: str | None, extra_env: dict[str, str], gpu_share: float) -> str:
            port = serve.free_port()
            cmd = [*cli, "serve", str(args.model), "--port", str(port), *flags]
            if args.device != "cpu":
                cmd += ["--gpu-memory-utilization", str(gpu_share)]
            if role is not None:
                cmd += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "SharedStorageConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": shared}})]
            base = f"http://127.0.0.1:{port}"
            procs.append(serve.start_server(cmd, dict(env, **extra_env),
                                            log_dir / f"{name}-{role or 'server'}.log", base,
                                            900, name=f"{name} {role or 'server'}"))
            return base

        if name == "single":
            base = start(None, {}, 0.85)
        else:
            half = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
            half = half if args.device == "cpu" else {}
            producer = start("kv_producer", half, 0.4)
            consumer = start("kv_consumer", half, 0.4)
            port = serve.free_port()
            base = f"http://127.0.0.1:{port}"
            procs.append(serve.start_server(
                [*cli, "proxy", "--prefill", producer, "--decode", consumer, "--port", str(port)],
                env, log_dir / f"{name}-proxy.log", base, 120, name="proxy"))
        asyncio.run(_load(base, warm))
        results, elapsed = asyncio.run(_load(base, pairs))
    except RuntimeError as exc:
        logger.warning("%s", exc)
        return dict(error=str(exc))
    finally:
        for proc in reversed(procs):
            serve.stop_server(proc)
        for f in Path(shared).iterdir():
            f.unlink()
        os.rmdir(shared)
    errors = sorted({e for _, _, e in results if e})
    return dict(elapsed_s=elapsed, ttft_s=[t for t, _, e in results if not e],
                texts=[t for _, t, _ in results], errors=errors)


def disagg_table(results: dict[str, dict[str, Any]], out_tokens: int) -> tuple[list[str], bool]:
    lines = ["| config | TTFT p50 ms | TTFT p99 ms | out tok/s | failed | texts = single |",
             "|---|---:|---:|---:|---:|---|"]
    ref, same_all = results.get("single", {}), True
    for name, r in results.items():
        if "error" in r or not r["ttft_s"]:
            lines.append(f"| {name} | {r.get('error') or r['errors']} | | | | |")
            same_all = False
            continue
        same = ""
        if "texts" in ref:
            agree = sum(a == b for a, b in zip(r["texts"], ref["texts"]))
            same, same_all = f"{agree}/{len(r['texts'])}", same_all and agree == len(r["texts"])
        failed = len(r["texts"]) - len(r["ttft_s"])
        lines.append(f"| {name} | {pct(r['ttft_s'], 0.5) * 1e3:.1f} | "
                     f"{pct(r['ttft_s'], 0.99) * 1e3:.1f} | {out_tokens / r['elapsed_s']:.1f} | "
                     f"{failed} | {same} |")
    return lines, same_all


def cpu_name() -> str:
    """'model name, family F, AVX-512 or AVX2 only' from /proc/cpuinfo."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text()
                    .split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return "unknown CPU"
    info = {k.strip(): v.strip() for k, v in info.items()}
    simd = "AVX-512" if "avx512f" in info.get("flags", "").split() else "AVX2 only"
    return f"{info.get('model name', '?')}, family {info.get('cpu family', '?')}, {simd}"


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m); a "
                   "config-only folder (make_model.py *-shape) loads with random weights")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--device-docs", type=int, default=2,
                   help="requests (document + question + output) the device cache holds")
    p.add_argument("--disagg-requests", type=int, default=32,
                   help="requests of the variable workload for single vs disagg (0: skip)")
    p.add_argument("--config", action="append", choices=OFFLOAD_CONFIGS + DISAGG_CONFIGS)
    p.add_argument("--disk-dir", type=Path, help="the disk tier's folder (on the local disk)")
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--output-json", type=Path)
    p.add_argument("--profile-dir", type=Path,
                   help="a torch profiler trace of --profile-requests timed requests from the "
                        "middle of each configuration's run, and its table, here")
    p.add_argument("--profile-requests", type=int, default=6)
    args = p.parse_args(argv)
    for name in ("docs", "doc_tokens", "questions", "question_tokens", "output_tokens",
                 "device_docs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.config = list(dict.fromkeys(args.config or OFFLOAD_CONFIGS + DISAGG_CONFIGS))
    return args


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        logging.basicConfig(level=logging.INFO)
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(run_child(spec)))
        return
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    sys.path.insert(0, str(BENCH_DIR))
    import throughput as tp
    from workloads import make_workload

    args = parse_args(argv)
    args.model = (args.model or tp.default_model(args.seed)).resolve()
    args.load_format = "auto" if any(args.model.glob("*.safetensors")) else "dummy"
    config = tp.load_model_config(args.model)
    avoid = tp.special_ids(args.model, config)
    vocab = [i for i in range(config["vocab_size"]) if i not in avoid]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-kv-offload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_name()
    load = os.getloadavg()
    lines = [f"model {args.model.name} ({args.load_format} weights), {args.dtype}, "
             f"device {args.device}; {cpu}, {os.cpu_count()} cores; load average before: "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; logs {log_dir}", ""]
    everything: dict[str, Any] = {}
    ok = True
    specs = {}
    if any(c in OFFLOAD_CONFIGS for c in args.config):
        prompts, warm = make_offload_workload(vocab, args)
        specs = offload_specs(args, config, prompts, warm)
        results = {name: run_offload(name, spec, log_dir) for name, spec in specs.items()}
        tokens = sum(map(len, prompts)) + len(prompts) * args.output_tokens
        some = next(iter(specs.values()))
        lines += [f"### offload: {args.docs} documents x {args.doc_tokens} tokens, "
                  f"{args.questions} questions of {args.question_tokens} tokens each (shuffled), "
                  f"{args.output_tokens} out; device cache {some['device_blocks']} blocks of "
                  f"{BLOCK_SIZE} (= {args.device_docs} requests)", ""]
        table, same = offload_table(results, tokens)
        lines += table + [""]
        if args.device == "cuda":
            doc_blocks = args.doc_tokens // BLOCK_SIZE
            lines += [copy_limit(doc_blocks * block_row_bytes(config, args.dtype)), ""]
        ok &= same
        everything["offload"] = {k: {f: v for f, v in r.items() if f != "token_ids"}
                                 for k, r in results.items()}
    if args.disagg_requests and any(c in DISAGG_CONFIGS for c in args.config):
        prompts, outs = make_workload("variable", vocab, args.seed)
        warm_prompts, warm_outs = make_workload("variable", vocab, args.seed, warmup=True)
        pairs = list(zip(prompts, outs))[:args.disagg_requests]
        warm_pairs = list(zip(warm_prompts, warm_outs))
        results = {name: run_serving(name, args, pairs, warm_pairs, log_dir)
                   for name in args.config if name in DISAGG_CONFIGS}
        lines += [f"### disaggregated prefill: {len(pairs)} requests of the variable workload "
                  f"({sum(len(p) for p, _ in pairs)} prompt / {sum(n for _, n in pairs)} output "
                  "tokens), all sent at once, streamed", ""]
        table, same = disagg_table(results, sum(n for _, n in pairs))
        lines += table + [""]
        ok &= same
        everything["disagg"] = {k: {f: v for f, v in r.items() if f != "texts"}
                                for k, r in results.items()}
    load = os.getloadavg()
    lines.append(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if not ok:
        lines.append("OUTPUTS DIFFER (or a configuration failed): see the tables")
    print("\n".join(lines))
    if args.output_json:
        args.output_json.write_text(json.dumps(everything))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
