"""The one-token GEMV (csrc/gemv_kernels.cu) against cuBLAS on one decode step's linears.

    python benchmarks/gemv_check.py            # on the GPU machine, from the repository root

Llama-3-8B's linears at batch 1 (32 layers x qkv / o_proj / gate_up / down, + the LM head), each
layer its own random bf16 weights (15 GB, so nothing is served from L2), all captured in one CUDA
graph per engine and variant; between two linears an rms_norm (as in the model) so that the
GEMV's early start has a kernel to overlap. Prints us per step, the weight bandwidth, its fraction
of the device-to-device copy bandwidth measured in the same run, and the ratio to cuBLAS.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.backends.cuda import ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_check import time_graph_ms  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 4096, 14336, 128256, 32
SHAPES = {"qkv": (6144, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}


def copy_bandwidth() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    kernels = ops.load_kernels()
    copy = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                      for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    weights["lm_head"] = [torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen,
                                      dtype=torch.bfloat16) * 0.02]
    norm_w = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    x = {k: torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
         for k in (HIDDEN, INTER)}
    engines = {
        "cublas": lambda a, w: F.linear(a, w),
        "gemv": lambda a, w: kernels.gemv(a, w, None, True),
        "gemv unstaged": lambda a, w: kernels.gemv(a, w, None, False),
    }
    print(f"copy bandwidth (read + write): {copy / 1e12:.2f} TB/s; kernel arch "
          f"{kernels.kernel_arch()}, programmatic launch {kernels.programmatic_launch_enabled()}")
    print("| linears | bytes | " + " | ".join(f"{e} us (TB/s, % copy)" for e in engines) +
          " | gemv / cublas |")
    print("|---|---:|" + "---:|" * (len(engines) + 1))
    total = {e: 0.0 for e in engines}
    for name, ws in weights.items():
        nbytes = sum(w.numel() * 2 for w in ws)
        cells, row = [], {}
        for engine, fn in engines.items():
            def body(fn=fn, ws=ws):
                for w in ws:
                    a = x[w.shape[1]]
                    if w.shape[1] == HIDDEN:  # the model's norm before qkv / gate_up / lm_head
                        a = kernels.rms_norm(a, norm_w, 1e-5, None)[0]
                    fn(a, w)
            row[engine] = us = time_graph_ms(lambda i, body=body: body(), args.repeats, 1) * 1e3
            total[engine] += us
            tbs = nbytes / us / 1e6
            cells.append(f"{us:,.0f} ({tbs:.2f}, {100 * tbs / (copy / 1e12):.0f}%)")
        print(f"| {name} | {nbytes / 1e9:.2f} GB | " + " | ".join(cells) +
              f" | {row['gemv'] / row['cublas']:.3f} |")
    print("step totals, us: " + ", ".join(f"{e} {t:,.0f}" for e, t in total.items()) +
          f"; gemv / cublas {total['gemv'] / total['cublas']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
