"""Dynamic per-token FP8 quantization of a linear's activations, as one Triton kernel: for each
row, scale = max(amax(|x|) / 448, 1e-12) and codes = clamp(x / scale) in float8_e4m3fn — the
arithmetic of ``reference.fp8_per_token`` (float32 throughout), in one launch instead of the ~6
elementwise kernels torch runs for it (a decode step of an 8B model quantizes 224 activations).

One program per row, two passes over it in BLOCK-wide chunks (the amax, then the codes). Runs on
CPU tensors under TRITON_INTERPRET=1 (how the tests exercise it without a GPU); the interpreter's
float8 conversion is wrong at binade edges (it rounds 31.9 to 16.0), so there the tests read the
scaled values before the conversion (``codes`` in float32) and the GPU run checks the codes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per chunk
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
MIN_SCALE = 1e-12


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, x_stride, q_stride, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * q_stride
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)  # IEEE division
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < cols)


def fp8_rows(x: torch.Tensor, codes_dtype: torch.dtype = torch.float8_e4m3fn
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (float, unit stride along K) -> (e4m3 codes [T, K], float32 scales [T, 1]).
    ``codes_dtype=torch.float32`` returns the clamped scaled values before the rounding to e4m3
    (for tests under the interpreter)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(rows, cols, dtype=codes_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _fp8_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                  MIN_SCALE=MIN_SCALE, BLOCK=BLOCK)
    return q, scale
