"""This machine's limits, measured once per benchmark run: GEMM peak per dtype and memory bandwidth.

    python benchmarks/roofline.py [--dtype float32 --dtype bfloat16] [--json OUT]

GEMM peak: the best GFLOP/s (2*M*N*K per call, best of several calls after a warm-up) of
torch.mm on square n x n operands (n up to 4096) and of oneDNN's linear with the weight packed
once in its preferred blocked layout (``torch.ops.mkldnn._linear_pointwise``, the route the cpu
backend's linears take) at a prefill-sized M=4096 on a 1024 -> 5632 projection (the bench99m
model's gate/up shape). With AVX-512 BF16 or AMX, oneDNN's bf16 kernels are the ones these
reach. Memory bandwidth: a 512 MiB tensor copied (bytes read + written) and summed (bytes
read), best of several passes. workloads.py runs this in its own process and prints every
result's achieved GFLOP/s as a fraction of the peak of its dtype.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("roofline")


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch pages, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def mm_gflops(dtype: torch.dtype, max_n: int = 4096, repeats: int = 5) -> tuple[float, int]:
    """torch.mm GFLOP/s at the largest n <= max_n whose call takes < 1 s (slow dtypes stay small)."""
    n = 512
    while n < max_n:
        a = torch.randn(n, n).to(dtype)
        if _best_seconds(lambda: torch.mm(a, a), 1) * 8 > 1.0:
            break
        n *= 2
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats) / 1e9, n


def packed_linear_gflops(dtype: torch.dtype, m: int = 4096, k: int = 1024, n: int = 5632,
                         repeats: int = 5) -> float | None:
    """oneDNN linear with a pre-packed weight [n, k] at M=m rows; None where it is unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=m)
        fn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        fn()
    except RuntimeError as exc:  # no oneDNN kernel for this dtype on this CPU
        logger.info("packed oneDNN linear unavailable for %s: %s", dtype, exc)
        return None
    return 2 * m * n * k / _best_seconds(fn, repeats) / 1e9


def memory_gbps(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Copy (read + write) and sum (read) bandwidth over a ``mib`` MiB float32 tensor, GB/s."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    read_s = _best_seconds(lambda: src.sum(), repeats)
    return dict(copy_gbps=2 * nbytes / copy_s / 1e9, read_gbps=nbytes / read_s / 1e9)


def measure(dtypes: list[str]) -> dict[str, Any]:
    """{"gemm_peak_gflops": {dtype: best}, "gemm_probes": {dtype: {route: GFLOP/s}}, copy_gbps,
    read_gbps, threads, cpu_capability}."""
    peaks: dict[str, float] = {}
    probes: dict[str, dict[str, Any]] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        mm, n = mm_gflops(dtype)
        packed = packed_linear_gflops(dtype)
        probes[name] = {f"torch.mm n={n}": mm, "oneDNN packed linear 4096x1024x5632": packed}
        peaks[name] = max(v for v in (mm, packed) if v is not None)
    return dict(gemm_peak_gflops=peaks, gemm_probes=probes, **memory_gbps(),
                threads=torch.get_num_threads(),
                cpu_capability=torch.backends.cpu.get_cpu_capability())


def describe(roofline: dict[str, Any]) -> str:
    """One line: each dtype's GEMM peak and the memory bandwidths."""
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in roofline["gemm_peak_gflops"].items())
    return (f"GEMM peak GFLOP/s: {peaks}; memory: copy {roofline['copy_gbps']:.1f} GB/s, read "
            f"{roofline['read_gbps']:.1f} GB/s; {roofline['threads']} threads, "
            f"{roofline['cpu_capability']}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args()
    result = measure(args.dtype or ["float32", "bfloat16"])
    logger.info("%s", describe(result))
    for name, routes in result["gemm_probes"].items():
        logger.info("%s: %s", name, ", ".join(f"{r} {v:.0f}" if v else f"{r} -"
                                               for r, v in routes.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
