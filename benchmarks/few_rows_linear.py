"""The cpu few-rows linear route (backends/cpu/few_rows.py) against the GEMM route it replaces for
proposers: every linear of the shipped EAGLE-3 head and draft model of the demo model, at 1 and
5 rows (a draft pass at batch 1; the mirror pass after a verification of k = 4), oneDNN's packed
weights (the route the cpu backend picked for float32 here) vs the kernel with a float32 and a
bf16 copy. Each layer is timed hot (its weights in cache: the draft passes after the first) and
all of a model's layers in turn, cycling over copies of them that overflow the caches (its
first pass of a step, after the target's forward evicted them); bytes over time next to the
machine's measured read bandwidth (a torch sum over 256 MB).

    python benchmarks/few_rows_linear.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import pagedllm  # noqa: E402,F401  (before torch: the OpenMP spin policy)
import torch  # noqa: E402

DEMO = REPO / "pagedllm" / "models" / "demo_model"


def shapes(folder: Path) -> list[tuple[str, int, int]]:
    """(name, out, in) of every 2-D weight of a checkpoint folder but the embedding."""
    from safetensors import safe_open

    found = []
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2 and "embed" not in name:
                found.append((name, int(shape[0]), int(shape[1])))
    if not any("lm_head" in n for n, _, _ in found):  # tied: the embedding is the LM head
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                if "embed_tokens" in name:
                    out, inp = f.get_slice(name).get_shape()
                    found.append(("lm_head (tied)", int(out), int(inp)))
    return found


def median_us(fn: Callable[[], Any], rounds: int, inner: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times) * 1e6


def read_bandwidth() -> float:
    big = torch.ones(64 * 1024 * 1024)
    return big.numel() * 4 / median_us(lambda: big.sum(), 5, 3) * 1e6 / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from pagedllm.backends.cpu.kernels import FEW_ROWS, load_cpu_kernels

    k = load_cpu_kernels(FEW_ROWS)
    bw = read_bandwidth()
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}; "
          f"measured read bandwidth {bw:.1f} GB/s")
    rows_out = []
    for model in ("eagle", "draft"):
        def layer_set() -> list[tuple]:
            """(name, out, in, oneDNN packing, kernel fp32 copy, kernel bf16 copy) per layer."""
            found = []
            for name, out, inp in shapes(DEMO / model):
                w = torch.randn(out, inp).bfloat16().float()  # a bf16 checkpoint in float32
                found.append((name, out, inp, torch.ops.mkldnn._reorder_linear_weight(w, 64),
                              k.few_rows_linear_pack(w), k.few_rows_linear_pack(w.bfloat16())))
            return found

        layers = layer_set()
        # copies of the model's layers enough to overflow the caches: a pass over the next copy
        # finds its weights in memory, as a proposer's first pass after the target's forward
        fp32_bytes = sum(o * i * 4 for _, o, i, *_ in layers)
        copies = [layers] + [layer_set() for _ in range(max(1, (96 << 20) // fp32_bytes))]
        for rows in (1, 5):
            routes = {
                "oneDNN": lambda x, L: torch.ops.mkldnn._linear_pointwise(x, L[3], None, "none",
                                                                          [], ""),
                "kernel fp32": lambda x, L: k.few_rows_linear(x, L[4], None, L[1]),
                "kernel bf16": lambda x, L: k.few_rows_linear(x, L[5], None, L[1]),
            }
            xs = {inp: torch.randn(rows, inp) for _, _, inp, *_ in layers}
            for name, out, inp, *_ in layers:
                L = next(layer for layer in layers if layer[0] == name)
                hot = {r: median_us(lambda f=f: f(xs[inp], L), args.rounds, 200)
                       for r, f in routes.items()}
                rows_out.append(dict(model=model, layer=name, rows=rows, shape=[out, inp],
                                     hot_us=hot))
            cold = {}
            for r, f in routes.items():
                turn = [0]

                def one_pass(f=f, turn=turn) -> None:
                    turn[0] = (turn[0] + 1) % len(copies)
                    for L in copies[turn[0]]:
                        f(xs[L[2]], L)
                cold[r] = median_us(one_pass, args.rounds, len(copies))
            rows_out.append(dict(model=model, layer="all, from memory", rows=rows,
                                 cold_us=cold, fp32_bytes=fp32_bytes))
    print("\n| model | layer | [out, in] | rows | oneDNN us | kernel fp32 us | kernel bf16 us "
          "| oneDNN / bf16 |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows_out:
        if "hot_us" in r:
            t = r["hot_us"]
            print(f"| {r['model']} | {r['layer']} | {r['shape']} | {r['rows']} | "
                  f"{t['oneDNN']:.1f} | {t['kernel fp32']:.1f} | {t['kernel bf16']:.1f} | "
                  f"{t['oneDNN'] / t['kernel bf16']:.2f}x |")
    print("\n| model | rows | pass from memory: oneDNN us | kernel fp32 us | kernel bf16 us "
          "| oneDNN / bf16 | fp32 bytes at the measured bandwidth |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        if "cold_us" in r:
            t = r["cold_us"]
            floor = r["fp32_bytes"] / (bw * 1e9) * 1e6
            print(f"| {r['model']} | {r['rows']} | {t['oneDNN']:.0f} | {t['kernel fp32']:.0f} | "
                  f"{t['kernel bf16']:.0f} | {t['oneDNN'] / t['kernel bf16']:.2f}x | "
                  f"{floor:.0f} us (bf16: {floor / 2:.0f}) |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(dict(bandwidth_gbs=bw, rows=rows_out),
                                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
