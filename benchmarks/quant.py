"""Quantized weights on the cpu backend: decode throughput and resident weight bytes of the 98.6M
Llama (make_model.py bench99m) in bfloat16 vs weight-only INT8 and INT4 (random quantized
weights, load_format="dummy", GPTQ layouts: INT8 per channel symmetric, INT4 groups of 128).

    python benchmarks/quant.py [--variants bf16,int8,int4,fp8] [--num-prompts 64] [--input-len 32]
                               [--output-len 64] [--repeats 3] [--no-kernels]
                               [--device cpu|cuda] [--preset bench99m|llama3-8b-shape]
                               [--vllm-python /work/venvs/vllm/bin/python]
    python benchmarks/quant.py --gemm 1,8,64,512 [--threads 1] [--repeats 5]

On an H200: ``--device cuda --preset llama3-8b-shape --variants bf16,int4 --num-prompts 1
--input-len 128 --output-len 128`` (batch 1) and ``--variants bf16,fp8 --num-prompts 1000
--input-len 128 --output-len 128`` (throughput).

Variant int8-lowp is the int8 checkpoint in the cpu backend's INT8 compute mode
(PAGEDLLM_CPU_QUANT_LOWP_MODE=int8: activations quantized per token). --vllm-python runs each
checkpoint on vLLM as well (its own process, same prompts, after one warm-up call), recording
its tok/s or the error it refuses the checkpoint with.

--no-kernels sets PAGEDLLM_CPU_QUANT_KERNELS=0 (the reference dequantize-and-multiply), the A/B
baseline of backends/cpu/quant_ops.py. Variants run round robin, each in this process; the
median of --repeats runs is reported with the weights' resident bytes (parameters, buffers and
the packed tensors the backend keeps on the layers, each storage counted once).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_model import make_config, make_tokenizer  # noqa: E402

logger = logging.getLogger("quant")
LOWP_MODE_ENV = "PAGEDLLM_CPU_QUANT_LOWP_MODE"  # backends/cpu/quant_ops.py

VARIANTS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "int8": {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
    "int4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},  # FP8 at load time
}
# variant -> (the checkpoint it loads, the cpu backend's lowp mode: quant_ops.py)
MODES: dict[str, tuple[str, str]] = {v: (v, "none") for v in VARIANTS}
MODES["int8-lowp"] = ("int8", "int8")  # the INT8 checkpoint computed in INT8


def model_dir(root: Path, variant: str, preset: str) -> Path:
    """config.json (+ quantization_config) and a tokenizer; weights come from load_format=dummy."""
    out = root / variant
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(preset, "bfloat16")
    if VARIANTS[variant] is not None:
        config.quantization_config = VARIANTS[variant]
    config.save_pretrained(out)
    make_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def resident_weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        try:
            ptr = t.untyped_storage().data_ptr()
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # opaque (mkldnn) tensors
            ptr, size = id(t), t.numel() * t.element_size()
        if ptr not in seen:
            seen.add(ptr)
            total += size

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def run(path: Path, prompts: list[list[int]], output_len: int, device: str) -> tuple[float, int]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(path), device=device, dtype="bfloat16", load_format="dummy")
    try:
        model = llm.llm_engine.executor.worker.model
        weight_bytes = resident_weight_bytes(model)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # warm-up outside the timing: kernel JIT compiles and library heuristics of first calls
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / elapsed, weight_bytes
    finally:
        llm.llm_engine.shutdown()


def gemm_bench(preset: str, rows: list[int], repeats: int) -> dict[str, Any]:
    """The cpu ops alone on the preset's linear shapes (q/k/v, o, gate/up, down): ms per layer
    for bf16 (the oneDNN packed linear the engine runs), INT8 / INT4 weight-only (default
    routing, and "-wo": torch's weight-only kernel at every row count) and INT8 lowp, each
    row count's variants timed in turn, best of ``repeats`` (this machine is shared: the best is
    the least disturbed)."""
    import types

    from pagedllm.backends.cpu import ops as cpu_ops
    from pagedllm.backends.cpu import quant_ops
    from pagedllm.models.layers.quantization.synthetic import ACT_NONE, LAYOUTS, SyntheticLinear

    cfg = make_config(preset, "bfloat16")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    shapes = [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, h), (h, h),
              (2 * inter, h), (h, inter)]  # [out, in]
    INT4_G128 = (torch.uint8, 4, 128, True, False, ACT_NONE)  # VARIANTS["int4"]'s layout
    INT8_G128 = (torch.uint8, 8, 128, True, False, ACT_NONE)  # llm-compressor's W8A16 g128
    # variant -> (layout, lowp mode, dequantize-route row threshold): "-wo" keeps torch's
    # weight-only kernel at every row count (the route before issue 32's dequantize + GEMM)
    # (None: quant_ops' default thresholds)
    variants = {"int8": ("int8-channel-sym", "none", None),
                "int8-wo": ("int8-channel-sym", "none", 1 << 30),
                "int8-lowp": ("int8-channel-sym", "int8", None),
                "int8-g128": (INT8_G128, "none", None),
                "int4": (INT4_G128, "none", None),
                "int4-wo": (INT4_G128, "none", 1 << 30)}
    layers: dict[str, list[Any]] = {"bf16": [], **{name: [] for name in variants}}
    for i, (out, inp) in enumerate(shapes):
        for name, (layout, mode, dequant_rows) in variants.items():
            os.environ[LOWP_MODE_ENV] = mode
            os.environ.pop(quant_ops.DEQUANT_ROWS_ENV, None)
            if dequant_rows is not None:
                os.environ[quant_ops.DEQUANT_ROWS_ENV] = str(dequant_rows)
            q = SyntheticLinear(LAYOUTS["gptq"].get(layout, layout), out, inp, torch.bfloat16,
                                torch.device("cpu"), seed=i)
            quant_ops.quant_linear_prepare(q)
            layers[name].append(q)
        os.environ.pop(quant_ops.DEQUANT_ROWS_ENV, None)
        dense = types.SimpleNamespace(weight=torch.nn.Parameter(
            torch.randn(out, inp, dtype=torch.bfloat16) * 0.02, requires_grad=False), bias=None)
        cpu_ops.linear_prepare(dense)
        layers["bf16"].append(dense)
    fns = {"bf16": cpu_ops.linear, **{name: quant_ops.quant_linear for name in variants}}
    report: dict[str, Any] = {}
    for m in rows:
        xs = [torch.randn(m, inp, dtype=torch.bfloat16) for _, inp in shapes]
        best = {name: float("inf") for name in layers}
        for _ in range(repeats):
            for name, ls in layers.items():
                for layer, x in zip(ls, xs):
                    fns[name](x, layer)  # warm
                start = time.perf_counter()
                n = 0
                while n < 3 or time.perf_counter() - start < 0.05:
                    for layer, x in zip(ls, xs):
                        fns[name](x, layer)
                    n += 1
                best[name] = min(best[name], (time.perf_counter() - start) / n)
        flops = 2 * m * sum(o * i for o, i in shapes)
        report[f"M={m}"] = {name: {"ms": t * 1e3, "gflop_s": flops / t / 1e9,
                                   "vs_bf16": best["bf16"] / t} for name, t in best.items()}
        logger.info("M=%d: %s", m, ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in best.items()))
    return report


def vllm_worker(spec_path: str, out_path: str) -> None:
    """Under the vLLM interpreter: the spec's checkpoint through vLLM's offline API (bf16
    activations, dummy weights), one warm-up call, then the timed call; the result (tok_s or the
    exception) as JSON."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {}
    try:
        llm = LLM(spec["path"], dtype="bfloat16", load_format="dummy",
                  max_model_len=spec["input_len"] + spec["output_len"] + 16)
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result["tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    except Exception as exc:  # noqa: BLE001 - what vLLM says is the result
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_path).write_text(json.dumps(result))


def run_vllm(vllm_python: str, path: Path, prompts: list[list[int]], input_len: int,
             output_len: int) -> dict[str, Any]:
    """vllm_worker in its own process; an engine that fails to start reports the root cause
    from its worker's log (the last ``SomethingError: ...`` line), not just the engine's."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"path": str(path), "prompts": prompts,
                                    "input_len": input_len, "output_len": output_len}))
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", TOKENIZERS_PARALLELISM="false")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        site = Path(__file__).resolve().parent / "_vllm_site"  # hides broken torchvision builds
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        proc = subprocess.run([vllm_python, __file__, "--vllm-worker", str(spec), str(out)],
                              env=env, capture_output=True, text=True)
        result = json.loads(out.read_text()) if out.exists() else {
            "error": f"exit code {proc.returncode}"}
        if "error" in result:
            causes = re.findall(r"\b(\w+(?:Error|Exception): .+)", proc.stdout + proc.stderr)
            if causes:
                result["root_cause"] = [c for c in causes if "See root cause" not in c][-1:]
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="bf16,int8,int4")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON"),
                        help="also run each checkpoint on vLLM under this interpreter "
                             "(default $PAGEDLLM_BENCH_VLLM_PYTHON; none: pagedllm only)")
    parser.add_argument("--vllm-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--gemm", default=None, metavar="ROWS",
                        help="instead of the engines: one layer's linears on the cpu ops alone "
                             "for these comma-separated row counts (e.g. 1,8,64,512)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="bench99m", choices=("bench99m", "llama3-8b-shape"))
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gemm:
        rows = [int(r) for r in args.gemm.split(",")]
        print(json.dumps({"threads": torch.get_num_threads(),
                          **gemm_bench(args.preset, rows, args.repeats)}, indent=2))
        return
    if args.no_kernels:
        os.environ["PAGEDLLM_CPU_QUANT_KERNELS"] = "0"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; choose from {list(MODES)}")
    rng = random.Random(0)
    vocab = make_config(args.preset, "bfloat16").vocab_size
    prompts = [[rng.randint(3, vocab - 1) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    results: dict[str, dict[str, Any]] = {v: {"tok_s": []} for v in variants}
    vllm: dict[str, dict[str, Any]] = {}  # checkpoint -> vLLM's tok/s or its error
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: model_dir(Path(tmp), MODES[v][0], args.preset) for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                os.environ[LOWP_MODE_ENV] = MODES[v][1]
                tok_s, weight_bytes = run(paths[v], prompts, args.output_len, args.device)
                results[v]["tok_s"].append(tok_s)
                results[v]["weight_bytes"] = weight_bytes
                logger.info("%s: %.1f tok/s, weights %.1f MiB", v, tok_s, weight_bytes / 2**20)
            for ckpt in dict.fromkeys(MODES[v][0] for v in variants) if args.vllm_python else ():
                r = vllm.setdefault(ckpt, {"tok_s": []})
                if "error" in r:  # a checkpoint vLLM refused is not retried
                    continue
                got = run_vllm(args.vllm_python, paths[ckpt] if ckpt in paths else
                               model_dir(Path(tmp), ckpt, args.preset), prompts, args.input_len,
                               args.output_len)
                r.update({k: v for k, v in got.items() if k != "tok_s"})
                if "tok_s" in got:
                    r["tok_s"].append(got["tok_s"])
                logger.info("vllm %s: %s", ckpt, got)
    base = results.get("bf16")
    for r in vllm.values():
        if r["tok_s"]:
            r["median_tok_s"] = statistics.median(r["tok_s"])
    for v, r in results.items():
        r["median_tok_s"] = statistics.median(r["tok_s"])
        peer = vllm.get(MODES[v][0], {})
        if peer.get("tok_s"):
            r["vs_vllm_same_checkpoint"] = r["median_tok_s"] / peer["median_tok_s"]
        if base is not None:
            r["vs_bf16_throughput"] = r["median_tok_s"] / statistics.median(base["tok_s"])
            r["vs_bf16_weight_bytes"] = r["weight_bytes"] / base["weight_bytes"]
    print(json.dumps({"kernels": not args.no_kernels, **results,
                      **({"vllm": vllm} if vllm else {})}, indent=2))


if __name__ == "__main__":
    main()
