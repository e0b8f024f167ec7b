"""Tensor parallelism: TP=N gives TP=1's greedy tokens, and how much faster it generates.

    # on a 2-GPU host (NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is forced for the runs)
    python benchmarks/tp_throughput.py --tp 2 --output-json benchmarks/results/tp2_h200.json
    # the same code paths on the CPU, in a minute (gloo, tiny shapes, a few prompts)
    python benchmarks/tp_throughput.py --device cpu --tiny

Two phases, each engine run in a subprocess of its own (so one run's GPU memory and process
group are gone before the next starts):

1. equality: a small random-weight float32 Llama checkpoint (make_model.py ``bench99m``, or
   ``tiny`` with --tiny), greedy, TP=1 vs TP=N: every prompt's tokens must be identical.
2. throughput: the Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads,
   intermediate 14336, vocab 128256) with ``load_format="dummy"`` random weights, offline
   ``LLM.generate`` of --num-prompts prompts x --input-len tokens in / --output-len out
   (ignore_eos), TP=1 vs TP=N, and the output-throughput ratio (target: --min-ratio, 1.6).
   Dummy weights are drawn per shard, so the two runs' tokens are not compared.

Exit status 1 when the tokens differ or the ratio is under --min-ratio (not checked with --tiny).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("tp_throughput")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_CACHE = Path.home() / ".cache" / "pagedllm" / "bench"
# NVLink multicast must stay off on shared hosts (it can take the host's GPUs down)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
FIRST_TOKEN_ID = 3  # ids 0-2 are <unk>, <s>, </s> in make_model.py's tokenizer


# --- models ------------------------------------------------------------------------------
def build_model(preset: str, dtype: str, cache: Path) -> Path:
    """make_model.py's ``preset`` (config + tokenizer, and weights unless config-only), cached."""
    out = cache / f"{preset}-{dtype}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    maker = BENCH_DIR / "make_model.py"
    if maker.exists():
        subprocess.run([sys.executable, str(maker), str(tmp), "--preset", preset, "--dtype", dtype],
                       check=True, env=child_env())
    else:
        write_config_only(tmp, preset)
    tmp.rename(out)
    return out


def write_config_only(out: Path, preset: str) -> None:
    """Fallback without make_model.py: a LlamaConfig plus the byte-level test tokenizer."""
    from transformers import LlamaConfig

    from pagedllm.testing.checkpoints import byte_tokenizer

    shapes = {"llama3-8b-shape": dict(hidden_size=4096, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=14336, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0),
              "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=352, vocab_size=512,
                           max_position_embeddings=512)}
    if preset not in shapes:
        raise SystemExit(f"benchmarks/make_model.py is missing and preset {preset!r} needs "
                         "weights; pass --model")
    tok = byte_tokenizer()
    if shapes[preset]["vocab_size"] < len(tok):
        raise SystemExit(f"vocab_size {shapes[preset]['vocab_size']} < tokenizer size {len(tok)}")
    config = LlamaConfig(**shapes[preset], bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    tok.save_pretrained(out)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)] for _ in range(n)]


# --- one engine run (the child process) --------------------------------------------------
def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, time ``generate`` over all prompts; tokens and timings."""
    import torch

    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(spec["model"], device=spec["device"], dtype=spec["dtype"],
              tensor_parallel_size=spec["tp"], load_format=spec["load_format"],
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              kv_cache_space_gib=spec["kv_cache_gib"], enforce_eager=spec["enforce_eager"],
              seed=spec["seed"])
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    warm = spec["warmup_prompts"]
    if warm:
        llm.generate(prompts[:warm], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    blocks = llm.llm_engine.config.cache.num_device_blocks
    llm.llm_engine.shutdown()
    return dict(tp=spec["tp"], load_s=load_s, elapsed_s=elapsed, token_ids=tokens,
                num_device_blocks=blocks, torch=torch.__version__,
                gpus=torch.cuda.device_count() if spec["device"] == "cuda" else 0)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in MULTICAST_OFF.items():
        if env.get(key, value) != value:
            logger.warning("overriding %s=%s with %s (multicast must stay off)", key, env[key],
                           value)
        env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_child(name: str, spec: dict[str, Any], log_dir: Path, timeout_s: float) -> dict[str, Any]:
    spec_path, result_path = log_dir / f"{name}.spec.json", log_dir / f"{name}.result.json"
    log_path = log_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    logger.info("running %s (TP=%d, %d prompts; log %s)", name, spec["tp"], len(spec["prompts"]),
                log_path)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # a session of its own, so a timeout also ends the run's worker processes
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path),
                                 str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=REPO_ROOT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except BaseException as exc:  # timeout or Ctrl-C: no engine process may outlive us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise SystemExit(f"{name} did not finish within {timeout_s:g} s (--child-timeout); "
                             f"killed it. Log: {log_path}") from None
    if proc.returncode != 0 or not result_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{name} failed (exit status {proc.returncode}); last log lines:\n{tail}")
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


# --- the two phases ----------------------------------------------------------------------
def base_spec(args: argparse.Namespace, model: Path, prompts: list[list[int]], output_len: int,
              dtype: str, load_format: str) -> dict[str, Any]:
    return dict(model=str(model), device=args.device, dtype=dtype, load_format=load_format,
                prompts=prompts, output_len=output_len,
                max_model_len=max(len(p) for p in prompts) + output_len,
                max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
                enforce_eager=args.enforce_eager, seed=args.seed,
                warmup_prompts=min(args.warmup_prompts, len(prompts)))


def equality(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    model = args.check_model or build_model("tiny" if args.tiny else "bench99m", "float32",
                                            args.cache_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.check_prompts, args.check_input_len, vocab, args.seed)
    spec = base_spec(args, model, prompts, args.check_output_len, "float32", "auto")
    one = run_child("equality_tp1", dict(spec, tp=1), log_dir, args.child_timeout)
    many = run_child(f"equality_tp{args.tp}", dict(spec, tp=args.tp), log_dir, args.child_timeout)
    same = sum(a == b for a, b in zip(one["token_ids"], many["token_ids"]))
    first_diff = next(([i, a, b] for i, (a, b) in enumerate(zip(one["token_ids"],
                                                                 many["token_ids"])) if a != b),
                      None)
    return dict(model=str(model), prompts=len(prompts), identical=same, first_difference=first_diff,
                ok=same == len(prompts))


def throughput(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    model = args.model or build_model("tiny" if args.tiny else "llama3-8b-shape", args.dtype,
                                      args.cache_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed + 1)
    spec = base_spec(args, model, prompts, args.output_len, args.dtype, args.load_format)
    runs = {}
    for tp in (1, args.tp):
        r = run_child(f"throughput_tp{tp}", dict(spec, tp=tp), log_dir, args.child_timeout)
        out_tokens = sum(len(t) for t in r.pop("token_ids"))
        expected = args.num_prompts * args.output_len
        if out_tokens != expected:
            raise SystemExit(f"TP={tp} produced {out_tokens} output tokens, expected {expected}")
        r.update(output_tokens=out_tokens, output_tok_per_s=out_tokens / r["elapsed_s"],
                 total_tok_per_s=(out_tokens + args.num_prompts * args.input_len) / r["elapsed_s"],
                 requests_per_s=args.num_prompts / r["elapsed_s"])
        runs[f"tp{tp}"] = r
    ratio = runs[f"tp{args.tp}"]["output_tok_per_s"] / runs["tp1"]["output_tok_per_s"]
    return dict(model=str(model), runs=runs, ratio=ratio)


def report(eq: dict[str, Any] | None, tput: dict[str, Any] | None,
           args: argparse.Namespace) -> bool:
    ok = True
    if eq is not None:
        print(f"\nequality (float32, {eq['model']}): {eq['identical']}/{eq['prompts']} prompts "
              f"identical TP=1 vs TP={args.tp} -> {'PASS' if eq['ok'] else 'FAIL'}")
        if eq["first_difference"]:
            i, a, b = eq["first_difference"]
            print(f"  first difference, prompt {i}:\n  TP=1 {a}\n  TP={args.tp} {b}")
        ok &= eq["ok"]
    if tput is not None:
        print(f"\nthroughput ({args.num_prompts} prompts x {args.input_len} in / {args.output_len} "
              f"out, {args.dtype}, load_format={args.load_format}, {tput['model']})\n")
        print("| TP | load s | elapsed s | req/s | output tok/s | total tok/s | KV blocks |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in tput["runs"].items():
            print(f"| {r['tp']} | {r['load_s']:.1f} | {r['elapsed_s']:.2f} | "
                  f"{r['requests_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
                  f"{r['total_tok_per_s']:.1f} | {r['num_device_blocks']} |")
        verdict = "not checked (--tiny)" if args.tiny else (
            "PASS" if tput["ratio"] >= args.min_ratio else "FAIL")
        print(f"\noutput throughput TP={args.tp} / TP=1: {tput['ratio']:.2f}x "
              f"(target >= {args.min_ratio}x): {verdict}")
        if not args.tiny:
            ok &= tput["ratio"] >= args.min_ratio
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_size to compare with 1")
    p.add_argument("--device", choices=["cuda", "cpu", "rocm"], default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes and few prompts: checks the code paths (e.g. on the CPU)")
    p.add_argument("--model", type=Path, help="throughput model (default: llama3-8b-shape)")
    p.add_argument("--check-model", type=Path, help="equality model (default: bench99m, fp32)")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--check-prompts", type=int, default=16)
    p.add_argument("--check-input-len", type=int, default=64)
    p.add_argument("--check-output-len", type=int, default=32)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--load-format", choices=["dummy", "auto"], default="dummy")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size per worker (default: the backend's own sizing)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--min-ratio", type=float, default=1.6)
    p.add_argument("--child-timeout", type=float, default=540.0,
                   help="seconds one engine run may take before it and its workers are killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("PAGEDLLM_BENCH_CACHE", DEFAULT_CACHE)))
    p.add_argument("--log-dir", type=Path, help="engine logs (default: a new temp dir)")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    if args.tp < 2:
        p.error(f"--tp must be >= 2 (it is compared with TP=1), got {args.tp}")
    if args.tiny:
        args.num_prompts = min(args.num_prompts, 16)
        args.input_len, args.output_len = min(args.input_len, 16), min(args.output_len, 16)
        args.check_prompts, args.check_input_len = min(args.check_prompts, 4), 16
        args.check_output_len = min(args.check_output_len, 8)
        args.max_num_seqs = min(args.max_num_seqs, 8)
        if args.device == "cpu" and args.dtype != "float32":
            args.dtype = "float32"
        if args.kv_cache_gib is None and args.device == "cpu":
            args.kv_cache_gib = 0.25
    for name in ("num_prompts", "input_len", "output_len", "check_prompts", "check_input_len",
                 "check_output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # one engine run: --child SPEC.json RESULT.json
        logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",  # pagedllm.logger's
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(run_engine(spec)))
        return 0
    logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",  # pagedllm.logger's
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-tp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    eq = None if args.skip_equality else equality(args, log_dir)
    tput = None if args.skip_throughput else throughput(args, log_dir)
    ok = report(eq, tput, args)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(dict(
            args={k: str(v) for k, v in vars(args).items()}, equality=eq, throughput=tput,
            ok=ok), indent=2))
        logger.info("wrote %s", args.output_json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
