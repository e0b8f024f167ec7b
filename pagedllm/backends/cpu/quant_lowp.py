"""INT8 compute for per-channel symmetric INT8 linears: the ``int8`` lowp mode of quant_ops.py.

y[t, o] = s_x[t] * s_w[o] * sum_k q_x[t, k] * q_w[o, k], where
  q_w [out, in] int8 in [-128, 127] (the checkpoint's codes - 128), s_w [out] float32;
  q_x [T, in] the token's activations rounded to int8: s_x[t] = max_k |x[t, k]| / 127,
  q_x = round(x / s_x) in [-127, 127] (symmetric, so one zero point for every token).
The product runs on oneDNN's int8 GEMM (torch.ops.onednn.qlinear_*, VNNI vpdpbusd with int32
accumulation) on weights packed once at load. oneDNN takes one activation scale and zero point
per call, so q_x is passed as uint8 q_x + 128 with zero point 128 and scale 1, the per-channel
weight scale is applied by oneDNN (float32 output) and the per-token scale after it. The int32
sums are exact; the float32 output rounds them to 24 bits (|sum| < 127^2 * in). The only loss
against the float computation is the activation rounding, |x - s_x q_x| <= s_x / 2.

The passes around the GEMM (the activation quantization and the per-token rescale) run on the
csrc/cpu kernels (quant_lowp_cpu.cpp, bit-identical to the torch functions here) where those
load; each replaces 5-6 torch ops that cost ~15% of a 64-row decode step's linears.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedllm.backends.cpu.kernels import QUANT, optional_cpu_kernels

logger = logging.getLogger(__name__)

ACT_QUANT = "int8_per_token"  # what layer.act_quant says once prepared (the conformance bound)
INT8_MAX = 127.0
_PACK_ROWS_HINT = 64  # oneDNN picks its packed layout for this many activation rows
_available: bool | None = None
_logged = False


def _cpu_kernels() -> Any:
    """The csrc/cpu kernels, or False where they do not build / are off."""
    return optional_cpu_kernels("lowp int8 runs its activation passes in torch", QUANT)


def available() -> bool:
    """True when torch's oneDNN int8 linear runs here and is exact at full range (checked once
    with a 1x64x16 call: CPUs without VNNI multiply u8 x s8 pairs into saturating int16)."""
    global _available
    if _available is None:
        try:
            codes = torch.tensor([127] * 8 + [-128] * 8, dtype=torch.int8)
            w = codes[:, None].expand(16, 64).contiguous()  # [16, 64]
            packed = torch.ops.onednn.qlinear_prepack(w, [1, 64])
            y = _qlinear(torch.full((1, 64), 255, dtype=torch.uint8), packed, torch.ones(16),
                         torch.zeros(16, dtype=torch.int64))
            _available = bool(torch.equal(y, 127.0 * 64 * codes.float()[None]))
            if not _available:
                logger.warning("cpu: oneDNN int8 linears are not exact here (no VNNI?); the "
                            "lowp int8 mode is off")
        except (RuntimeError, AttributeError) as exc:
            logger.warning("cpu: oneDNN int8 linears unavailable (%s); the lowp int8 mode is off",
                           exc)
            _available = False
    return _available


def _qlinear(qx: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
             w_zero: torch.Tensor) -> torch.Tensor:
    """[T, in] uint8 (zero point 128) x packed int8 weights -> [T, out] float32 sums * w_scale."""
    return torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, packed, w_scale, w_zero, None, 1.0, 0,
                                             torch.float32, "none", [], "")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (q_x + 128 as uint8 [T, in], s_x float32 [T, 1]); see the module doc."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(min=1e-30)
    q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).add_(128).to(torch.uint8)
    return q, scale


def scale_rows(y: torch.Tensor, s_x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T, N] float32 * s_x [T, 1] -> [T, N] dtype, one rounding."""
    return y.mul_(s_x).to(dtype)


def prepare(layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Pack ``weight`` [out, in] int8 (codes - 128) with its per-channel ``scale`` [out]."""
    global _logged
    out, inp = weight.shape
    layer.cpu_lowp_weight = torch.ops.onednn.qlinear_prepack(weight.contiguous(),
                                                             [_PACK_ROWS_HINT, inp])
    layer.cpu_lowp_scale = scale.float().contiguous()  # [out]
    layer.cpu_lowp_zero = torch.zeros(out, dtype=torch.int64)
    layer.act_quant = ACT_QUANT
    if not _logged:
        _logged = True
        logger.info("cpu: INT8 linears compute in INT8 (lowp mode int8: activations quantized "
                    "per token to int8, lossy; PAGEDLLM_CPU_QUANT_LOWP_MODE=none keeps them in "
                    "the model dtype)")


def linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype (no bias)."""
    if x.shape[0] == 0:
        return x.new_empty((0, layer.cpu_lowp_scale.shape[0]))
    kernels = _cpu_kernels()
    fast = kernels is not False and x.is_contiguous()
    q, s_x = kernels.quantize_per_token(x) if fast else quantize_per_token(x)
    y = _qlinear(q, layer.cpu_lowp_weight, layer.cpu_lowp_scale, layer.cpu_lowp_zero)
    return kernels.scale_rows(y, s_x, x.dtype) if fast else scale_rows(y, s_x, x.dtype)
