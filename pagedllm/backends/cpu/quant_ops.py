"""Weight-only INT8 / INT4 linears on CPU through torch's packed kernels.

``quant_linear_prepare`` re-packs a quantized linear (models/layers/quantization canonical
layout) once after loading, where the layout fits a kernel:
  - 8-bit codes, symmetric (every zero point 128), one scale per output channel:
    ``torch._weight_int8pack_mm`` (int8 weights [out, in], scales [out]);
  - 4-bit codes in groups of 32/64/128/256 in column order (no act-order g_idx):
    ``torch._weight_int4pack_mm_for_cpu``, which computes (q - 8) * scale + offset per group, so
    the zero point z becomes the offset (8 - z) * scale.
  - 8-bit codes, symmetric, in groups (llm-compressor's W8A16 group 128): int8 codes [out, in]
    and one scale per group, always through the dequantize route below, in float32.
Both run in the activation dtype with float accumulation (exact to float32 rounding for float32
models). Those kernels are GEMV-like, slow at many rows: from $PAGEDLLM_CPU_QUANT_DEQUANT_ROWS
rows (default ``DEQUANT_MIN_ROWS``, ``DEQUANT_MIN_ROWS_INT4`` for INT4) the layer's weight is
dequantized into one per-thread scratch buffer in the activation dtype (sized to the largest
layer seen, so resident memory is the quantized weights plus one layer's dense copy:
``scratch_bytes()``) and the dense GEMM runs on it. INT8 codes are exact in bf16 (the
per-channel scale multiplies the output); INT4 is unpacked from torch's packed layout by
csrc/cpu/quant_dequant_cpu.cpp (out a multiple of torch's packed block, 64 rows on AVX-512 and
32 on AVX2: ``int4pack_block_n`` probes which; float32 / bf16 activations; otherwise torch's
kernel runs at every row count). Other layouts (act order, FP8 weights) keep the reference
dequantize-and-multiply. The packed weights replace the codes (the INT4 packing is half a byte
per weight). PAGEDLLM_CPU_QUANT_KERNELS=0 keeps the reference everywhere (for A/B checks).

Low-precision compute mode (IPEX's ``lowp_mode``), PAGEDLLM_CPU_QUANT_LOWP_MODE:
  - ``none`` (default): weight-only, as above: activations stay in the model dtype, so results
    match the dequantized reference to float rounding;
  - ``int8``: the per-channel symmetric INT8 route computes in INT8 (quant_lowp.py): each token's
    activations are quantized dynamically to int8 (one scale per token, amax / 127), multiplied
    with the int8 weights on oneDNN's VNNI kernels (int32 accumulation) and rescaled by the
    token's scale x the channel's weight scale. That is lossy (each activation is rounded to one
    of 255 levels of its token's range, |error| <= amax / 254) and about twice the MACs per
    instruction of the bf16 dot products, so it is a mode to opt into, logged once when a model
    uses it. Other layouts ignore it.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.backends.cpu import quant_lowp
from pagedllm.backends.cpu.kernels import QUANT, optional_cpu_kernels
from pagedllm.reference.quant import quant_linear as reference_quant_linear

logger = logging.getLogger(__name__)

QUANT_KERNELS_ENV = "PAGEDLLM_CPU_QUANT_KERNELS"
LOWP_MODE_ENV = "PAGEDLLM_CPU_QUANT_LOWP_MODE"
LOWP_MODES = ("none", "int8")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEQUANT_ROWS_ENV = "PAGEDLLM_CPU_QUANT_DEQUANT_ROWS"
# rows from which dequantize + dense GEMM beats torch's weight-only INT8 kernel (1 thread, K/N
# 1024 x 2816, bf16: 0.57 vs 0.74 ms at 8 rows, 1.17 vs 0.95 ms at 16, 8.7 vs 2.2 ms at 64)
DEQUANT_MIN_ROWS = 12
# the same for INT4 (its weight-only kernel is faster; the unpacking costs more): best of 5,
# 1 thread, bench99m's linears: 4.2 vs 6.8 ms at 16 rows, 8.4 vs 8.5 at 32, 16.8 vs 12.0 at 64
DEQUANT_MIN_ROWS_INT4 = 32
_scratch = threading.local()  # .buffers: dtype -> flat tensor, this thread's dequantized weight


def _cpu_kernels() -> Any:
    """The csrc/cpu kernels, or False where they do not build / are off."""
    return optional_cpu_kernels("INT4 linears keep torch's weight-only kernel at every batch",
                                QUANT)


def quant_kernels_enabled() -> bool:
    return envs.PAGEDLLM_CPU_QUANT_KERNELS


def lowp_mode() -> str:
    """The compute mode of INT8 linears from $PAGEDLLM_CPU_QUANT_LOWP_MODE (see the module doc)."""
    return envs.PAGEDLLM_CPU_QUANT_LOWP_MODE  # one of LOWP_MODES (validated by envs)


def dequant_min_rows(route: str = "int8") -> int:
    """Rows from which ``route`` ("int8" or "int4") dequantizes and runs the dense GEMM:
    $DEQUANT_ROWS_ENV for both where set, else DEQUANT_MIN_ROWS / DEQUANT_MIN_ROWS_INT4."""
    rows = envs.PAGEDLLM_CPU_QUANT_DEQUANT_ROWS  # an integer >= 1 (validated by envs)
    if rows is None:
        return DEQUANT_MIN_ROWS_INT4 if route == "int4" else DEQUANT_MIN_ROWS
    return rows


def scratch_bytes() -> int:
    """Bytes of this thread's dequantization scratch buffers (the resident cost of the route)."""
    buffers = getattr(_scratch, "buffers", {})
    return sum(b.numel() * b.element_size() for b in buffers.values())


def _scratch_weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A [out, in] view of this thread's scratch buffer for ``dtype``, grown to fit."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    n = shape[0] * shape[1]
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n:
        buf = buffers[dtype] = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


def _dequantized_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [T, in] @ dequantized weight^T on the dense GEMM; the weight lives in the scratch."""
    if layer.cpu_quant_route == "int4":  # W^T [in, out]: (q - 8) * scale + offset per group
        wt = _scratch_weight((x.shape[1], layer.cpu_out_features), x.dtype)
        _cpu_kernels().int4pack_dequant(layer.cpu_int4_weight, layer.cpu_int4_scales_zeros,
                                        layer.cpu_int4_group_size, int4pack_block_n(), wt)
        return F.linear(x, wt.t())
    codes = layer.cpu_int8_weight  # [out, in] int8, the checkpoint's codes - 128
    if layer.cpu_quant_route == "int8":  # per channel: exact codes, the scale on the output
        w = _scratch_weight(tuple(codes.shape), x.dtype)
        return F.linear(x, w.copy_(codes)).mul_(layer.cpu_int8_scale)
    # per-group scales cannot move to the output: the weight is dequantized in float32 (codes x
    # scale rounded once, as the reference) and so is the GEMM (a bf16 weight would add a
    # rounding per weight: outside the conformance bound)
    out, inp = codes.shape
    scale = layer.cpu_int8_group_scale  # [out, groups, 1] float32
    groups = scale.shape[1]
    w32 = _scratch_weight((out, inp), torch.float32)
    torch.mul(codes.view(out, groups, inp // groups), scale,
              out=w32.view(out, groups, inp // groups))
    return F.linear(x.float(), w32).to(x.dtype)


@functools.lru_cache(maxsize=None)
def int4pack_block_n() -> int:
    """Rows per block of ``torch._convert_weight_to_int4pack_for_cpu``'s layout here: it follows
    the CPU capability torch dispatches to (64 on AVX-512, 32 on AVX2; byte (b, k, d) holds
    rows B b + d and B b + B / 2 + d). Probed by packing known codes; 0 for a layout the
    unpacking kernel does not know (then torch's own kernel runs at every row count)."""
    n, k = 64, 32
    codes = (torch.arange(n * k, dtype=torch.int32).reshape(n, k) * 7) % 16  # [n, k]
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
    for block in (64, 32):
        half = block // 2
        blocks = codes.reshape(n // block, block, k)
        want = blocks[:, :half] | (blocks[:, half:] << 4)  # [n / B, B / 2, k]
        if torch.equal(want.transpose(1, 2).reshape(-1).to(torch.uint8), packed):
            return block
    logger.info("cpu: torch's int4 packed layout (capability %s) is not one the unpacking kernel "
                "knows; INT4 linears keep torch's kernel at every batch",
                torch.backends.cpu.get_cpu_capability())
    return 0


def _int4_dequant_fits(x: torch.Tensor, layer: Any) -> bool:
    """The INT4 unpacking kernel takes torch's packed layout for out a multiple of its block,
    float32 / bf16 activations in the scales' dtype, and needs the csrc/cpu kernels."""
    block = int4pack_block_n()
    return (block > 0 and layer.cpu_out_features % block == 0
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.dtype == layer.cpu_int4_scales_zeros.dtype and _cpu_kernels() is not False)


def _route(layer: nn.Module) -> str | None:
    """"int8", "int8_grouped", "int4" or None (the reference) for this layer's layout."""
    q, w = layer.quant, layer.weight
    if w.dtype != torch.uint8 or q.zero is None or q.act != "none":
        return None
    bits = q.method.bits
    if bits == 8 and q.scale.shape[1] == 1 and bool((q.zero == 128).all()):
        return "int8"
    if (bits == 8 and q.g_idx is None and q.group_size and q.group_size * q.scale.shape[1]
            == w.shape[1] and bool((q.zero == 128).all())):
        return "int8_grouped"
    if (bits == 4 and q.g_idx is None and q.group_size in INT4_GROUP_SIZES
            and w.shape[1] % q.group_size == 0):
        return "int4"
    return None


def quant_linear_prepare(layer: nn.Module) -> None:
    """Pack the layer's codes for the kernel its layout fits (see the module doc)."""
    layer.cpu_quant_route = None
    if not quant_kernels_enabled():
        return
    route = _route(layer)
    if route is None:
        return
    q, codes = layer.quant, layer.weight.data
    dtype = layer.ctx.dtype
    if route == "int8" and lowp_mode() == "int8" and quant_lowp.available():
        route = "int8_lowp"
    try:
        if route == "int8_lowp":
            quant_lowp.prepare(layer, (codes.to(torch.int16) - 128).to(torch.int8), q.scale[:, 0])
        elif route == "int8":
            layer.cpu_int8_weight = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            layer.cpu_int8_scale = q.scale[:, 0].to(dtype).contiguous()  # [out]
        elif route == "int8_grouped":
            layer.cpu_int8_weight = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            layer.cpu_int8_group_scale = q.scale.float()[:, :, None].contiguous()  # [out, G, 1]
        else:
            gs = q.group_size
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            # [in / gs, out, 2]: (scale, offset) per group and output channel
            scales_zeros = torch.stack([q.scale.t(), ((8 - q.zero) * q.scale).t()], dim=-1)
            layer.cpu_int4_weight = packed
            layer.cpu_int4_scales_zeros = scales_zeros.to(dtype).contiguous()
            layer.cpu_int4_group_size = gs
    except RuntimeError as exc:  # a shape the kernel does not take
        logger.info("cpu: %s kernel unavailable for a %s linear (%s); the reference runs",
                    route, tuple(codes.shape), exc)
        return
    layer.cpu_quant_route = route
    layer.cpu_dequant_min_rows = dequant_min_rows(route)  # read once: bad values fail at load
    layer.cpu_out_features = codes.shape[0]
    # the codes are no longer read: keep a 0-element placeholder of the same dtype
    layer.weight = nn.Parameter(codes.new_empty((0, codes.shape[1])), requires_grad=False)


def quant_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype."""
    route = getattr(layer, "cpu_quant_route", None)
    if route is None:
        return reference_quant_linear(x, layer)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if route == "int8_lowp":
        y = quant_lowp.linear(x2, layer)
    elif route == "int8_grouped" or (route == "int8"
                                     and x2.shape[0] >= layer.cpu_dequant_min_rows):
        y = _dequantized_linear(x2, layer)
    elif (route == "int4" and x2.shape[0] >= layer.cpu_dequant_min_rows
          and _int4_dequant_fits(x2, layer)):
        y = _dequantized_linear(x2, layer)
    elif route == "int8":
        y = torch._weight_int8pack_mm(x2, layer.cpu_int8_weight, layer.cpu_int8_scale)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2, layer.cpu_int4_weight, layer.cpu_int4_group_size,
                                              layer.cpu_int4_scales_zeros)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], layer.cpu_out_features)


def register(ops: Any) -> None:
    ops.register("quant_linear", quant_linear)
    ops.register("quant_linear_prepare", quant_linear_prepare)
