"""The few-rows linear route: linears of a model built with ``LayerContext.few_rows`` (a
speculative proposer: its draft passes run one row per drafting sequence) keep, beside their
oneDNN / MKL packing, a copy laid out for csrc/cpu/few_rows_linear_cpu.cpp, which ``linear``
takes for 1..8 rows; more rows (a proposer's pass over a prompt) take the GEMM as before.

Why a second copy and only for these models: at a few rows oneDNN's packed GEMM costs a fixed
~25-40 us a call on a two-core VM, several times the arithmetic of a proposer's small layers,
and streams weights from memory at ~12-18 GB/s (2026-12-07, benchmarks/RESULTS.md issue 43); the
kernel runs those layers 2-3.5x faster. It cannot replace the packed GEMM (its layout is 1.2-2x
slower at prefill sizes through a batched matmul), so a model on this route holds its float
linears twice: a few MB for a proposer, but as much again as the weights for a target, which is
why targets never take it. The copy is bfloat16 where every weight is a bf16 value (a bf16
checkpoint run in float32 or bf16: half the bytes, nothing rounded), else float32; inputs are
upcast to float32 and outputs rounded back to the input's dtype.

Whether the route runs is decided once per process: the kernel must load (the cpu kernels'
``pagedllm_cpu_few_rows`` library) and, timed on a proposer-sized linear at one and five rows,
beat the layer's GEMM route at both (``few_rows_route``; PAGEDLLM_CPU_FEW_ROWS_LINEAR=on or off
forces it). Importing this module imports nothing heavy beyond torch.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from pagedllm import envs
from pagedllm.backends.cpu.route_timing import median_times

logger = logging.getLogger(__name__)

FEW_ROWS_ENV = "PAGEDLLM_CPU_FEW_ROWS_LINEAR"
MAX_ROWS = 8  # the kernel's row limit (few_rows_linear_cpu.cpp kMaxRows)


def _kernels() -> Any:
    from pagedllm.backends.cpu.kernels import FEW_ROWS, optional_cpu_kernels

    return optional_cpu_kernels("few-row linears of proposers run oneDNN's GEMM", FEW_ROWS)


@functools.lru_cache(maxsize=None)
def few_rows_route() -> bool:
    """Whether few-rows models' linears take the kernel at 1..8 rows in this process."""
    choice = envs.PAGEDLLM_CPU_FEW_ROWS_LINEAR  # None, "on" or "off"
    if choice == "off":
        return False
    kernels = _kernels()
    if kernels is False:
        return False
    if choice == "on":
        return True
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 768, generator=gen)
    packed = kernels.few_rows_linear_pack(w)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    runs = {}
    for rows in (1, 5):
        x = torch.randn(rows, 768, generator=gen)
        runs[f"kernel{rows}"] = (lambda x=x: kernels.few_rows_linear(x, packed, None, 1024))
        runs[f"gemm{rows}"] = (lambda x=x: torch.ops.mkldnn._linear_pointwise(
            x, onednn, None, "none", [], ""))
    times = median_times(runs, rounds=15)
    on = all(times[f"kernel{r}"] < times[f"gemm{r}"] for r in (1, 5))
    logger.info("proposers' few-row linears %s (a 1024x768 linear at 1 / 5 rows: kernel %.1f / "
                "%.1f us, oneDNN %.1f / %.1f us; %s=on|off forces it)",
                "on the few-rows kernel" if on else "on oneDNN", times["kernel1"] * 1e6,
                times["kernel5"] * 1e6, times["gemm1"] * 1e6, times["gemm5"] * 1e6, FEW_ROWS_ENV)
    return on


def few_rows_prepare(layer: Any) -> None:
    """Before ``linear_prepare`` packs and releases ``layer.weight``: the kernel's copy, when the
    layer's model runs few rows (``layer.ctx.few_rows``) and the route is on."""
    ctx = getattr(layer, "ctx", None)
    weight = layer.weight.data
    if (not getattr(ctx, "few_rows", False) or weight.dim() != 2
            or not weight.is_floating_point() or not few_rows_route()):
        return
    kernels = _kernels()
    layer.few_rows_weight = kernels.few_rows_linear_pack(_lossless_narrow(weight))
    bias = getattr(layer, "bias", None)
    layer.few_rows_bias = bias.data.to(torch.float32) if bias is not None else None
    layer.few_rows_out = int(weight.shape[0])


def _lossless_narrow(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as bfloat16 where every value is one (a bf16 checkpoint's weights in a float32
    model: half the bytes the kernel streams, the same products), else as float32."""
    wide = weight.to(torch.float32).contiguous()
    narrow = wide.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(torch.float32), wide) else wide


def few_rows_linear(x: torch.Tensor, layer: Any) -> torch.Tensor | None:
    """x [..., in] -> [..., out] through the kernel where ``layer`` has its copy and x has
    1..``MAX_ROWS`` rows; None otherwise (the caller takes the GEMM)."""
    packed = getattr(layer, "few_rows_weight", None)
    if packed is None:
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS:
        return None
    flat = x.reshape(rows, x.shape[-1]).to(torch.float32).contiguous()
    y = torch.ops.pagedllm_cpu.few_rows_linear(flat, packed, layer.few_rows_bias,
                                                layer.few_rows_out)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
