"""Faster CPU ops: linears with weights pre-packed once at load time.

float32 models run MKL's packed sgemm or oneDNN's packed weights, whichever is faster on this CPU,
decided once per process by timing both on a decode-sized GEMM (``fp32_linear_route``;
PAGEDLLM_CPU_FP32_LINEAR=mkl or onednn forces one). The two differ by CPU: on the AMX Intel
machine of RESULTS.md MKL was ~10% faster at 64 rows, on an AVX-512 AMD EPYC (Zen 4) oneDNN was
1.35x faster end to end. MKL's packed layout does not depend on the batch-size hint it is packed
with, only its speed does (a hint of 256 is as fast as 64 at 64 rows and faster above), so one
packing serves every row count; ``mkl_packed_linear_supported`` checks that against F.linear once
per process. The MKL packing takes 1.1-2.3x the weight's memory (4096x4096: 1.13x, 1024x1024:
2.27x; a fixed ~6 MB per matrix at tiny shapes), in place of the weight (below).

Half-precision models, and float32 ones on the oneDNN route, run oneDNN's (mkldnn) packed weights.
Half precision: where oneDNN has no native bf16/fp16 GEMM (AVX2-only CPUs; torch's
fallback runs ~20x slower than fp32), or has one that is slower than its float32 GEMM (AVX-512
CPUs with the bf16 dot-product instructions but no AMX: 1.39x slower on the benchmark's decode
shapes), the weights are packed as float32 (their values are exactly representable) and the input
is upcast: products of half values are exact in float32 and accumulation is in float32, as a
native bf16 GEMM with fp32 accumulation does; the output is rounded back to the model dtype. The
float32 route costs twice the weight memory. Which route runs is decided once per process by
timing both on a decode-sized GEMM (``half_compute_dtype``); PAGEDLLM_CPU_HALF_LINEAR=native or
float32 forces one.

Memory: once a linear is packed, the packed copy is the only one. ``linear`` never reads
``layer.weight`` after ``linear_prepare`` (N-D inputs are flattened to 2-D, other dtypes converted;
torch's packed sgemm takes the plain weight too but only checks its dtype and reads its shape while
it is told the row count it was packed for, so it gets a zero-cost stride-0 NaN placeholder), and
``linear_prepare`` swaps the weight for a ``ReleasedWeight``: same shape, dtype and device, no
storage, and any op on it raises. A model thus holds its linear weights once (twice for bf16/fp16
on the float32 route, 1.1-2.3x on MKL's route) instead of two or three times. The weight stays where
something else holds it (a tied LM head is the embedding's table; an expert's slice of a larger
tensor frees nothing) and where nothing was packed. PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS=1 keeps every
weight (debugging). Where glibc keeps freed memory (heap.py) the released pages stay in its heap for
later allocations: on the 99M-parameter bf16 benchmark model the RSS after loading fell by 110 of
the 172 MiB released (by all of it with PAGEDLLM_CPU_KEEP_FREED_MEMORY=0).
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.backends.cpu.few_rows import few_rows_linear, few_rows_prepare
from pagedllm.backends.cpu.route_timing import median_times

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64
_MKL_PACK_BATCH_HINT = 256
FP32_LINEAR_ENV = "PAGEDLLM_CPU_FP32_LINEAR"
FP32_LINEAR_CHOICES = ("mkl", "onednn")


@functools.lru_cache(maxsize=None)
def mkl_packed_linear_supported() -> bool:
    """Whether torch has MKL's packed sgemm and a weight packed for one batch size computes any
    row count correctly (checked against F.linear; the plain weight passed beside the packing is
    ``linear``'s NaN placeholder, so a silent fallback to it would show)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(80, 200, generator=gen)
        b = torch.randn(80, generator=gen)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, _MKL_PACK_BATCH_HINT)
        for rows in (1, 7, 64, 300, 1100):
            x = torch.randn(rows, 200, generator=gen)
            y = torch.ops.mkl._mkl_linear(x, packed, shape_only_weight(w), b, rows)
            if not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                return False
        return True
    except (RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def fp32_linear_route() -> str:
    """"mkl" or "onednn": the route float32 linears take (see the module doc); "onednn" also
    where neither runs (linear_prepare then leaves F.linear)."""
    choice = envs.PAGEDLLM_CPU_FP32_LINEAR  # None or one of FP32_LINEAR_CHOICES
    if not mkl_packed_linear_supported():
        return "onednn"
    if choice or not onednn_linear_supported(torch.float32):
        return choice or "mkl"
    w, x = _probe_operands(torch.float32)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, _MKL_PACK_BATCH_HINT)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    times = median_times({
        "mkl": lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, x.shape[0]),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
    })
    route = min(times, key=times.get)
    logger.info("float32 linears on %s (a 64-row GEMM: mkl %.3f ms, onednn %.3f ms; %s forces "
                "one)", route, times["mkl"] * 1e3, times["onednn"] * 1e3, FP32_LINEAR_ENV)
    return route


def _probe_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes' timing probe, a decode-sized linear: weight [2048, 1024], input [64, 1024]."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2048, 1024, generator=gen).to(dtype),
            torch.randn(64, 1024, generator=gen).to(dtype))


@functools.lru_cache(maxsize=None)
def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs a packed linear natively in ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none",
                                           [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


HALF_LINEAR_ENV = "PAGEDLLM_CPU_HALF_LINEAR"
HALF_LINEAR_CHOICES = ("native", "float32")


@functools.lru_cache(maxsize=None)
def half_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``dtype`` (bf16/fp16) model's linears run in: ``dtype`` itself where oneDNN
    runs it natively and not slower than the float32 route, else float32 (see the module doc)."""
    choice = envs.PAGEDLLM_CPU_HALF_LINEAR  # None or one of HALF_LINEAR_CHOICES
    if not onednn_linear_supported(dtype):
        return torch.float32
    if choice:
        return dtype if choice == "native" else torch.float32
    if not onednn_linear_supported(torch.float32):
        return dtype
    w, x = _probe_operands(dtype)
    packed = {c: torch.ops.mkldnn._reorder_linear_weight(w.to(c), _PACK_BATCH_HINT)
              for c in (dtype, torch.float32)}

    def run(compute: torch.dtype) -> Callable[[], Any]:
        return lambda: torch.ops.mkldnn._linear_pointwise(x.to(compute), packed[compute], None,
                                                          "none", [], "").to(dtype)

    times = median_times({"native": run(dtype), "float32": run(torch.float32)})
    compute = dtype if times["native"] <= times["float32"] else torch.float32
    logger.info("%s linears compute in %s (a 64-row GEMM: native %.3f ms, float32 %.3f ms; %s "
                "forces one)", dtype, compute, times["native"] * 1e3, times["float32"] * 1e3,
                HALF_LINEAR_ENV)
    return compute


KEEP_UNPACKED_ENV = "PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS"


def shape_only_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``dtype`` tensor of ``weight``'s shape backed by one NaN (stride 0): what torch's packed
    sgemm takes as the plain weight, whose dtype it checks and whose shape it reads; were its
    values ever read, the output would be NaN."""
    return torch.full((), float("nan"), dtype=dtype, device=weight.device).expand(weight.shape)


class ReleasedWeight(torch.Tensor):
    """A packed linear's weight once the packed copy is the only one: shape, dtype and device as
    before (parameter counts and dtype look-ups keep working), no storage; every op on it raises
    a RuntimeError naming the layer and the switch that keeps weights."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, owner: str) -> ReleasedWeight:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                device=like.device, requires_grad=False)
        t.owner = owner
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        released = args[0]
        if func is torch.ops.aten.detach.default:  # nn.Parameter(...) detaches its data
            return ReleasedWeight(released, released.owner)
        raise RuntimeError(
            f"{func}: the weight of {released.owner} was released after the cpu backend packed "
            f"it (the packed copy is the only one; pagedllm/backends/cpu/ops.py); compute through "
            f"the linear op, or set {KEEP_UNPACKED_ENV}=1 to keep unpacked weights")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ReleasedWeight({self.owner})"


def keep_unpacked_weights() -> bool:
    """$PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS=1: packed layers keep their plain weights too."""
    return envs.PAGEDLLM_CPU_KEEP_UNPACKED_WEIGHTS


def _weight_refcount(layer: Any) -> int:
    weight = layer.weight
    return sys.getrefcount(weight)


@functools.lru_cache(maxsize=None)
def _sole_holder_refcount() -> int:
    """``_weight_refcount`` of a weight that only its layer holds (calibrated, not assumed: the
    count's base differs between Python versions)."""
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(1), requires_grad=False)
    return _weight_refcount(layer)


def _release_weight(layer: Any) -> None:
    """Swap ``layer.weight`` for a ``ReleasedWeight`` where that frees its memory: the layer is
    its only holder (a tied LM head shares the embedding's parameter, which the embedding reads)
    and it owns its whole storage (an expert's slice of a larger tensor frees nothing)."""
    weight = layer.weight
    if keep_unpacked_weights() or isinstance(weight, ReleasedWeight):
        return
    if weight.untyped_storage().nbytes() != weight.numel() * weight.element_size():
        return
    del weight
    if _weight_refcount(layer) != _sole_holder_refcount():
        return
    weight = layer.weight
    released = ReleasedWeight(weight, f"{type(layer).__name__}{list(weight.shape)}")
    layer.weight = (nn.Parameter(released, requires_grad=False)
                    if isinstance(weight, nn.Parameter) else released)


def linear_prepare(layer: Any) -> None:
    """Pack ``layer.weight`` [out, in] for ``linear`` and release the plain weight where that is
    safe (see the module doc); layers left unpacked (no oneDNN) keep it for F.linear."""
    few_rows_prepare(layer)  # a proposer's layer: the few-rows kernel's copy too
    weight = layer.weight.data
    if weight.dtype == torch.float32 and weight.is_contiguous() and fp32_linear_route() == "mkl":
        layer.mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_PACK_BATCH_HINT)
        layer.mkl_shape_weight = shape_only_weight(weight)
        del weight
        _release_weight(layer)
        return
    compute = (weight.dtype if weight.dtype == torch.float32
               else half_compute_dtype(weight.dtype))
    if not onednn_linear_supported(compute):
        return  # no oneDNN: plain F.linear
    bias = getattr(layer, "bias", None)
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute),
                                                                  _PACK_BATCH_HINT)
    layer.packed_bias = bias.data.to(compute) if bias is not None else None
    layer.compute_dtype = compute
    del weight
    _release_weight(layer)


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype; a packed layer's plain weight is never read."""
    few = few_rows_linear(x, layer)
    if few is not None:
        return few
    mkl = getattr(layer, "mkl_weight", None)
    if mkl is not None:
        # [M, in] float32 rows; the packed sgemm computes them from the packing only when told M
        # is its batch size (otherwise torch falls back to F.linear with the plain weight)
        rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
        y = torch.ops.mkl._mkl_linear(rows, mkl, layer.mkl_shape_weight,
                                      getattr(layer, "bias", None), rows.shape[0])
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, getattr(layer, "bias", None))
    # oneDNN's linear takes [..., in] of any leading shape
    y = torch.ops.mkldnn._linear_pointwise(x.to(layer.compute_dtype), packed, layer.packed_bias,
                                           "none", [], "")
    return y.to(x.dtype)
