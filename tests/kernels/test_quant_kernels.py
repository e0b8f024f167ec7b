"""csrc/quantization's 4-bit linears (GEMV for decode, tiled GEMM for prefill) run on the CPU
through the SIMT emulator (tests/kernels/simt_emu) against a float64 dequantized reference.

The layout is built from the canonical quantized layout by
pagedllm.backends.cuda.quant_ops.int4_gpu_layout, so this also checks that conversion.
Tolerance: float32 accumulation of K products (a few ulps of sum |w x|) plus one rounding of the
output to the dtype."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from pagedllm.backends.cuda.quant_ops import int4_gpu_layout

_HERE = Path(__file__).resolve().parent
_CSRC = _HERE.parents[1] / "csrc"
_SOURCES = (_CSRC / "quantization" / "int4_linear.cu", _HERE / "simt_emu" / "quant_entry.cpp")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    deps = sorted(_SOURCES) + sorted(_CSRC.glob("*.h")) + sorted(_CSRC.glob("*.cuh")) + \
        sorted((_CSRC / "quantization").glob("*.h")) + [_HERE / "simt_emu" / "simt_emu.h"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in deps)).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm") / "emu"
    path = root / f"quant_emu_{digest}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        objs = []
        for src in _SOURCES:
            obj = root / f"{src.stem}_{digest}_{os.getpid()}.o"
            subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
                            "-include", str(_HERE / "simt_emu" / "simt_emu.h"), f"-I{_CSRC}",
                            "-x", "c++", "-c", str(src), "-o", str(obj)], check=True)
            objs.append(obj)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["g++", "-shared", "-o", str(tmp)] + [str(o) for o in objs], check=True)
        tmp.replace(path)
        for obj in objs:
            obj.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    lib.quant_emu_last_error.restype = ctypes.c_char_p
    lib.quant_emu_reset(ctypes.c_uint64(7))
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def run_int4(lib: ctypes.CDLL, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.full((m, n), float("nan"), dtype=x.dtype)
    rc = lib.quant_emu_int4_linear(
        _DTYPES[x.dtype], _ptr(y), ctypes.c_int64(y.stride(0)), _ptr(x), ctypes.c_int64(x.stride(0)),
        _ptr(qweight), _ptr(scales), _ptr(offsets), m, n, k, group_size)
    assert rc == 0, lib.quant_emu_last_error().decode()
    return y


def layer(n: int, k: int, group_size: int, seed: int) -> types.SimpleNamespace:
    """A canonical 4-bit linear (uint8 codes [n, k], float32 scale / zero [n, k / gs])."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    quant = types.SimpleNamespace(
        scale=torch.rand(n, groups, generator=gen) * 0.02 + 1e-3,
        zero=torch.randint(0, 16, (n, groups), generator=gen).float(), g_idx=None,
        group_size=group_size)
    return types.SimpleNamespace(
        weight=torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8), quant=quant)


# (m, n, k, group_size): decode rows 1-8 (GEMV) and prefill rows (GEMM) with edges that leave
# partial tiles and partial GEMV blocks
CASES = [(1, 64, 128, 32), (3, 37, 256, 64), (8, 130, 128, 128), (9, 33, 64, 32),
         (45, 70, 128, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, gs", CASES)
def test_int4_linear_matches_float64(lib, m: int, n: int, k: int, gs: int,
                                     dtype: torch.dtype) -> None:
    from pagedllm.models.layers.quantization.reference import dequantize_weight

    lay = layer(n, k, gs, seed=m * 1000 + n)
    qweight, scales, offsets = int4_gpu_layout(lay)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = run_int4(lib, x, qweight, scales, offsets, gs)
    w64 = dequantize_weight(lay, torch.float64)
    ref = x.double() @ w64.t()
    mag = x.double().abs() @ w64.abs().t()
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    tol = 64 * 2.0 ** -23 * mag + ulp * ref.abs() + 1e-30
    assert not y.isnan().any(), "an output was not written"
    assert ((y.double() - ref).abs() <= tol).all()


def test_refuses_unsupported_group(lib) -> None:
    lay = layer(16, 64, 32, seed=0)
    qweight, scales, offsets = int4_gpu_layout(lay)
    x = torch.randn(2, 64)
    y = torch.zeros(2, 16)
    rc = lib.quant_emu_int4_linear(0, _ptr(y), ctypes.c_int64(16), _ptr(x), ctypes.c_int64(64),
                                   _ptr(qweight), _ptr(scales), _ptr(offsets), 2, 16, 64, 48)
    assert rc != 0
