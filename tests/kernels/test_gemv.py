"""GEMV kernel (csrc/gemv_kernels.cu): out = x @ W^T + b for decode batches of 1-8 rows; its
argument checks (pagedllm/backends/cuda/checks.py) and the ``linear`` op built on it
(pagedllm/backends/cuda/layer_ops.py).

The kernel runs on the GPU through the extension (skipped without one) and on the CPU through the
SIMT emulator, against a float64 reference: it accumulates in float32 and rounds each output once,
so the error is at most one rounding step of the dtype plus the float32 summation error. Outputs
are poisoned with NaN, with a guard row and guard columns that must stay untouched.
"""
from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from pagedllm.backends.cuda.checks import KernelArgumentError, check_gemv
from pagedllm.backends.cuda.layer_ops import GEMV_MAX_ROWS, gemv_fits, layer_ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]

# (m, n, k, layout). n = 37 is no multiple of the 4 rows of a warp or the 16 of a block; k = 264
# is a partial step only, k = 1064 full steps and a tail (16-bit: 133 vectors of 8; float32: 266
# of 4, with 128 vectors per step), k = 8 one vector. "strided": x, weight and out are views with
# a row stride wider than the row.
CASES = ([(m, 37, 264, "contiguous") for m in range(1, GEMV_MAX_ROWS + 1)]
         + [(1, 1, 8, "contiguous"), (5, 5, 8, "contiguous"), (3, 20, 1064, "contiguous"),
            (8, 70, 1064, "strided"), (2, 16, 4096, "contiguous"), (7, 33, 264, "strided")])


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _backend(request: pytest.FixtureRequest, fixture: str) -> tuple[ModuleType, str]:
    return request.getfixturevalue(fixture), ("cuda" if fixture == "cuda_ops" else "cpu")


def _matrix(rows: int, cols: int, layout: str, dtype: torch.dtype, device: str,
            gen: torch.Generator, scale: float) -> torch.Tensor:
    """[rows, cols] random values; "strided": a view with 16 more elements per row."""
    pad = 16 if layout == "strided" else 0
    full = (torch.randn(rows, cols + pad, generator=gen) * scale).to(dtype).to(device)
    return full[:, :cols]


def _inputs(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: str,
            with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = _matrix(m, k, layout, dtype, device, gen, 1.0)
    weight = _matrix(n, k, layout, dtype, device, gen, k ** -0.5)
    bias = (torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None)
    return x, weight, bias


def _reference(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T + b, sum_k |x w| + |b|) in float64: the exact result and its error scale."""
    x64, w64 = x.cpu().double(), weight.cpu().double()
    exact, magnitude = x64 @ w64.T, x64.abs() @ w64.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.cpu().double(), magnitude + bias.cpu().double().abs()
    return exact, magnitude


def _assert_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, what: str) -> None:
    """Within one rounding step of the dtype (subnormal spacing near zero) plus the float32
    rounding of the per-lane chain and the lane tree (~k / 32 + 8 additions deep)."""
    exact, magnitude = _reference(x, weight, bias)
    got = got.cpu().double()
    assert not got.isnan().any(), f"{what}: NaN in the output (an element was not written)"
    info, f32 = torch.finfo(x.dtype), torch.finfo(torch.float32)
    depth = x.shape[1] / 32 + 8
    tol = info.eps * exact.abs() + info.tiny * info.eps + depth * f32.eps * magnitude
    err = (got - exact).abs()
    assert (err <= tol).all(), f"{what}: max error / tolerance {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m,n,k,layout", CASES)
def test_gemv(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype, with_bias: bool,
              m: int, n: int, k: int, layout: str) -> None:
    ops, device = _backend(request, fixture)
    x, weight, bias = _inputs(m, n, k, layout, dtype, device, with_bias)
    guarded = torch.full((m + 1, n + 3), float("nan"), dtype=dtype, device=device)
    out = guarded[:m, :n] if layout == "strided" else guarded[:m, :n].contiguous()
    got = ops.gemv(out, x, weight, bias)
    assert got.data_ptr() == out.data_ptr()
    _assert_close(out, x, weight, bias, f"gemv m={m} n={n} k={k}")
    if layout == "strided":  # the guard row (a 9th row for m = 8) and columns stay untouched
        assert guarded[m].isnan().all() and guarded[:, n:].isnan().all()


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=_dtype_id)
def test_gemv_rows_do_not_depend_on_the_batch(request: pytest.FixtureRequest, fixture: str,
                                              dtype: torch.dtype) -> None:
    """Row i of the output is the same bits whatever the number of rows (1-8 run four kernel
    variants): CUDA graphs pad a decode batch to a captured size, eager mode does not."""
    ops, device = _backend(request, fixture)
    x, weight, bias = _inputs(GEMV_MAX_ROWS, 37, 1064, "contiguous", dtype, device, True)
    full = ops.gemv(torch.empty(GEMV_MAX_ROWS, 37, dtype=dtype, device=device), x, weight, bias)
    for m in range(1, GEMV_MAX_ROWS):
        part = ops.gemv(torch.empty(m, 37, dtype=dtype, device=device), x[:m], weight, bias)
        assert torch.equal(part.view(torch.int16), full[:m].view(torch.int16)), f"m={m}"


@pytest.mark.parametrize("fixture", BACKENDS)
def test_gemv_float32_k_multiple_of_4(request: pytest.FixtureRequest, fixture: str) -> None:
    """float32 rows need only 4 elements per 16-byte vector."""
    ops, device = _backend(request, fixture)
    x, weight, bias = _inputs(3, 9, 12, "contiguous", torch.float32, device, True)
    out = torch.full((3, 9), float("nan"), device=device)
    _assert_close(ops.gemv(out, x, weight, bias), x, weight, bias, "gemv k=12")


@pytest.mark.parametrize("fixture", BACKENDS)
def test_gemv_empty(request: pytest.FixtureRequest, fixture: str) -> None:
    ops, device = _backend(request, fixture)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    weight = torch.ones(16, 64, dtype=torch.bfloat16, device=device)
    assert ops.gemv(torch.empty(0, 16, dtype=torch.bfloat16, device=device), x, weight).numel() == 0


# ---- argument checks: checks.check_gemv (CPU tensors reach every check but the device one) ------


def _bad_calls(gemv: Callable[..., object],
               device: str) -> list[tuple[str, Callable[[], object]]]:
    """(name the error must mention, call) for gemv = check_gemv or ops.gemv."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x, w, b, out = (torch.ones(2, 64, **bf16), torch.ones(16, 64, **bf16), torch.ones(16, **bf16),
                    torch.empty(2, 16, **bf16))
    unaligned = torch.ones(2 * 64 + 1, **bf16)[1:].view(2, 64)
    return [
        ("weight", lambda: gemv(out, x.float(), w, b)),       # dtype mismatch
        ("x", lambda: gemv(out, x.int(), w, b)),              # not a float dtype
        ("x", lambda: gemv(out, x[0], w, b)),                 # not [m, k]
        ("x", lambda: gemv(torch.empty(9, 16, **bf16), torch.ones(9, 64, **bf16), w, b)),
        ("k", lambda: gemv(out, x[:, :60], w[:, :60], b)),    # k % 8 != 0
        ("weight", lambda: gemv(out, x, w[:, :56], b)),       # k mismatch
        ("weight", lambda: gemv(out, x, w.half(), b)),
        ("bias", lambda: gemv(out, x, w, b[:8])),
        ("bias", lambda: gemv(out, x, w, b.float())),
        ("bias", lambda: gemv(out, x, w, torch.ones(32, **bf16)[::2])),
        ("out", lambda: gemv(out[:, :8], x, w, b)),
        ("out", lambda: gemv(out.t().contiguous().t(), x, w, b)),
        ("x", lambda: gemv(out, unaligned, w, b)),            # 2-byte aligned rows
        ("x", lambda: gemv(out, x.t().contiguous().t()[:, :64], w, b)),
        ("weight", lambda: gemv(out, x, w.t().contiguous().t(), b)),
        ("out", lambda: gemv(w[:2, :16], w[:2, :64], w, None)),  # out overlaps its inputs
        ("out", lambda: gemv(out[:1].expand(2, 16), x, w, b)),     # rows of out overlap
    ]


def test_check_gemv_rejects_bad_arguments() -> None:
    for name, call in _bad_calls(check_gemv, "cpu"):
        with pytest.raises(KernelArgumentError, match=rf"^{name}\b"):
            call()


def test_check_gemv_requires_cuda() -> None:
    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="CUDA"):
        check_gemv(torch.empty(2, 16, **bf16), torch.ones(2, 64, **bf16),
                   torch.ones(16, 64, **bf16), None)


def test_gemv_bad_arguments_raise(cuda_ops: ModuleType) -> None:
    for name, call in _bad_calls(cuda_ops.gemv, "cuda"):
        with pytest.raises(RuntimeError, match=rf"\b{name}\b"):
            call()
    x = torch.ones(2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"\bweight\b"):  # weight on the CPU
        cuda_ops.gemv(torch.empty(2, 16, dtype=torch.bfloat16, device="cuda"), x, x.cpu()[:, :64])


# ---- the linear op -----------------------------------------------------------------------------


def test_gemv_fits() -> None:
    bf16 = dict(dtype=torch.bfloat16)
    w, b = torch.ones(16, 64, **bf16), torch.ones(16, **bf16)
    assert gemv_fits(torch.ones(64, **bf16), w, b)
    assert gemv_fits(torch.ones(2, 4, 64, **bf16), w, None)  # 8 rows
    assert not gemv_fits(torch.ones(9, 64, **bf16), w, b)
    assert not gemv_fits(torch.ones(2, 64), w.float(), b.float())  # float32: F.linear
    assert not gemv_fits(torch.ones(2, 60, **bf16), w[:, :60].contiguous(), b)
    assert not gemv_fits(torch.ones(64, 2, **bf16).t(), w, b)
    assert not gemv_fits(torch.ones(2 * 64 + 1, **bf16)[1:].view(2, 64), w, b)
    assert not gemv_fits(torch.ones(2, 64, **bf16), w.half(), b)
    assert not gemv_fits(torch.ones(2, 64, **bf16), w.t().contiguous().t(), b)
    assert not gemv_fits(torch.ones(2, 64, **bf16), w, b.half())


def test_linear_keeps_f_linear_on_the_cpu() -> None:
    """CPU tensors (and every case gemv_fits rejects) run F.linear unchanged."""
    calls: list[str] = []
    kernels = SimpleNamespace(gemv=lambda *args: calls.append("gemv"))
    table = layer_ops(kernels)  # type: ignore[arg-type]
    layer = SimpleNamespace(weight=torch.randn(16, 64).bfloat16(), bias=torch.randn(16).bfloat16())
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(table["linear"](x, layer), F.linear(x, layer.weight, layer.bias))
    assert not calls


@pytest.mark.parametrize("shape", [(64,), (1, 64), (2, 3, 64), (8, 64), (9, 64), (2, 5, 64)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_op(cuda_ops: ModuleType, shape: tuple[int, ...], with_bias: bool) -> None:
    """x [..., k] with at most GEMV_MAX_ROWS rows runs the gemv kernel, more rows F.linear."""
    kernels = cuda_ops.load_kernels()
    calls: list[tuple[int, ...]] = []

    def gemv(out: torch.Tensor, x: torch.Tensor, *args: object) -> None:
        calls.append(tuple(x.shape))
        kernels.gemv(out, x, *args)

    table = layer_ops(SimpleNamespace(gemv=gemv))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(len(shape))
    weight = (torch.randn(40, 64, generator=gen) / 8).bfloat16().cuda()
    bias = torch.randn(40, generator=gen).bfloat16().cuda() if with_bias else None
    x = torch.randn(*shape, generator=gen).bfloat16().cuda()
    got = table["linear"](x, SimpleNamespace(weight=weight, bias=bias))
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.bfloat16
    rows = x.numel() // 64
    assert calls == ([(rows, 64)] if rows <= GEMV_MAX_ROWS else [])
    _assert_close(got.reshape(-1, 40), x.reshape(-1, 64), weight, bias, f"linear {shape}")
