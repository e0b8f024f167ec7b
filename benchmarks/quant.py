"""Quantized weights on the cpu backend: decode throughput and resident weight bytes of the 98.6M
Llama (make_model.py bench99m) in bfloat16 vs weight-only INT8 and INT4 (random quantized
weights, load_format="dummy", GPTQ layouts: INT8 per channel symmetric, INT4 groups of 128).

    python benchmarks/quant.py [--variants bf16,int8,int4,fp8] [--num-prompts 64] [--input-len 32]
                               [--output-len 64] [--repeats 3] [--no-kernels]
                               [--device cpu|cuda] [--preset bench99m|llama3-8b-shape]

On an H200: ``--device cuda --preset llama3-8b-shape --variants bf16,int4 --num-prompts 1
--input-len 128 --output-len 128`` (batch 1) and ``--variants bf16,fp8 --num-prompts 1000
--input-len 128 --output-len 128`` (throughput).

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
import statistics
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
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / elapsed, weight_bytes
    finally:
        llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="bf16,int8,int4")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="bench99m", choices=("bench99m", "llama3-8b-shape"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
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
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: model_dir(Path(tmp), MODES[v][0], args.preset) for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                os.environ[LOWP_MODE_ENV] = MODES[v][1]
                tok_s, weight_bytes = run(paths[v], prompts, args.output_len, args.device)
                results[v]["tok_s"].append(tok_s)
                results[v]["weight_bytes"] = weight_bytes
                logger.info("%s: %.1f tok/s, weights %.1f MiB", v, tok_s, weight_bytes / 2**20)
    base = results.get("bf16")
    for v, r in results.items():
        r["median_tok_s"] = statistics.median(r["tok_s"])
        if base is not None:
            r["vs_bf16_throughput"] = r["median_tok_s"] / statistics.median(base["tok_s"])
            r["vs_bf16_weight_bytes"] = r["weight_bytes"] / base["weight_bytes"]
    print(json.dumps({"kernels": not args.no_kernels, **results}, indent=2))


if __name__ == "__main__":
    main()
