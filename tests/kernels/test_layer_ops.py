"""Layer kernels (csrc/layer_kernels.cu): rms_norm, rotary, silu_and_mul; and their wiring
(pagedllm/backends/cuda/layer_ops.py, CudaBackend.register_ops).

Each kernel runs on the GPU through the extension (skipped without one) and on the CPU through the
SIMT emulator, and is compared with
  * a float64 reference: within one rounding step of the dtype (plus a few float32 ulps for the
    float32 reductions and exp);
  * the torch reference op of pagedllm/models/layers/ops.py on the same device: bit for bit for
    rotary (every dtype) and for silu_and_mul in float16/bfloat16 on the GPU. rms_norm sums its
    squares in another order than torch's reduction, and on the CPU glibc's expf is not torch's
    vectorized exp, so there the value rounded inside the op (the normalized row, silu(gate)) may be
    one ulp of the dtype away: the output must be what the reference makes of such a neighbour.
Emulated outputs are allocated poisoned with NaN; on the GPU the caching allocator is poisoned.
"""
from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers import ops as reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _backend(request: pytest.FixtureRequest, fixture: str) -> tuple[ModuleType, str]:
    return request.getfixturevalue(fixture), ("cuda" if fixture == "cuda_ops" else "cpu")


def _rows(t: int, width: int, layout: str, dtype: torch.dtype, device: str,
          gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[t, width] random rows: contiguous, a view with a wider row stride, or misaligned by one
    element (forces the scalar path)."""
    row = width + (24 if layout == "strided" else 0)
    buf = (torch.randn(t * row + 1, generator=gen) * scale).to(dtype).to(device)
    if layout == "offset1":
        return buf[1:].view(t, row)
    rows = buf[: t * row].view(t, row)
    return rows[:, 8 : 8 + width] if layout == "strided" else rows


def _poison_allocator(device: str, *numels: int) -> None:
    """Free all-ones blocks (NaN in every float dtype) of at least the outputs' sizes, in order, so
    that the binding's torch::empty likely reuses them."""
    if device == "cuda":
        blocks = [torch.full((n,), -1, dtype=torch.int32, device=device) for n in numels]
        blocks.clear()


def _assert_f64_close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype, what: str, floor: torch.Tensor | float = 2.0) -> None:
    """|got - ref| within one rounding step of the dtype relative to `scale`; an intermediate
    rounded into the subnormals adds up to `floor` subnormal spacings."""
    got = got.cpu().double()
    assert not got.isnan().any(), f"{what}: NaN in the output (an element was not written)"
    # eps * (1 + eps): two chained roundings of at most half an eps each; plus a few float32 ulps
    info = torch.finfo(dtype)
    tol = (info.eps * (1 + info.eps) + 8 * torch.finfo(torch.float32).eps) * scale
    tol = tol + info.tiny * info.eps * floor
    err = (got - ref).abs()
    assert (err <= tol).all(), f"{what}: max error / tolerance {(err / tol).max().item():.3g}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.cpu().view(as_int), b.cpu().view(as_int))


def _neighbours(t: torch.Tensor) -> list[torch.Tensor]:
    """t and the adjacent representable values of its 16-bit dtype (zero: +-smallest subnormal)."""
    bits = t.view(torch.int16)
    zero = t == 0
    up = torch.where(zero, torch.ones_like(bits), bits + 1)
    down = torch.where(zero, torch.full_like(bits, -32767), bits - 1)  # 0x8001: -smallest
    return [t, up.view(t.dtype), down.view(t.dtype)]


def _assert_one_step(got: torch.Tensor, inner: torch.Tensor,
                     outer: Callable[[torch.Tensor], torch.Tensor], what: str) -> None:
    """got == outer(v) where v is the reference's rounded inner value or one of its neighbours,
    and for nearly all elements v is the reference's own value."""
    got = got.cpu()
    candidates = [outer(v).cpu() for v in _neighbours(inner)]
    exact = _bits_equal(got, candidates[0])
    ok = exact | _bits_equal(got, candidates[1]) | _bits_equal(got, candidates[2])
    assert ok.all(), f"{what}: {int((~ok).sum())} elements more than one inner rounding step off"
    inexact = int((~exact).sum())
    assert inexact <= max(2, got.numel() // 100), f"{what}: {inexact} of {got.numel()} not exact"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int16) == b.view(torch.int16)


# ---- rms_norm ---------------------------------------------------------------------------------

# rows of up to 1,024 accesses per block run from registers (csrc/layer_kernels.cu kRowUnits); 9000
# and 1100 (scalar accesses, offset1) take the looping path
NORM_CASES = [(1, 4096, "contiguous"), (7, 4096, "strided"), (37, 200, "contiguous"),
              (7, 72, "strided"), (37, 72, "offset1"), (5, 13, "contiguous"),
              (3, 9000, "contiguous"), (2, 1100, "offset1")]


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("t,hidden,layout", NORM_CASES)
def test_rms_norm(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype,
                  with_residual: bool, t: int, hidden: int, layout: str) -> None:
    ops, device = _backend(request, fixture)
    gen = torch.Generator().manual_seed(t * hidden + with_residual)
    x = _rows(t, hidden, layout, dtype, device, gen, scale=3.0)
    residual = _rows(t, hidden, layout, dtype, device, gen) if with_residual else None
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(dtype).to(device)
    eps = 1e-5
    _poison_allocator(device, t * hidden, t * hidden)
    normed, new_residual = ops.rms_norm(x, weight, eps, residual)
    assert normed.shape == (t, hidden) and normed.is_contiguous() and normed.dtype == dtype

    _, ref_residual = reference.rms_norm(x, weight, eps, residual)
    assert _same_bits(new_residual, ref_residual)
    h = new_residual.cpu().double()
    expected = weight.cpu().double() * h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    _assert_f64_close(normed, expected, expected.abs(), dtype, "rms_norm",
                      floor=1 + weight.cpu().double().abs())
    h_exact = x.cpu().double() + (0 if residual is None else residual.cpu().double())
    _assert_f64_close(new_residual, h_exact, h_exact.abs(), dtype, "rms_norm residual")
    if dtype in HALF_DTYPES:  # the reference rounds h * rsqrt(...) to the dtype, then * weight
        inner = F.rms_norm(ref_residual.float(), (hidden,), None, eps).to(dtype)
        _assert_one_step(normed, inner, lambda v: weight * v.to(device), "rms_norm vs torch")


# ---- rotary -----------------------------------------------------------------------------------

ROTARY_CASES = [(1, 128, "qkv"), (7, 64, "contiguous"), (37, 128, "qkv"), (37, 64, "padded"),
                (7, 6, "contiguous"), (5, 64, "offset1")]
NUM_Q_HEADS, NUM_KV_HEADS = 8, 2  # rotated together, as the model does


def _rotary_inputs(t: int, d: int, layout: str, dtype: torch.dtype, device: str,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads = NUM_Q_HEADS + NUM_KV_HEADS
    if layout == "qkv":  # the model's view: q and k of the fused projection output
        qkv = torch.randn(t, (heads + NUM_KV_HEADS) * d, generator=gen).to(dtype).to(device)
        x = qkv[:, : heads * d].reshape(t, heads, d)
        assert x.data_ptr() == qkv.data_ptr() and (t == 1 or x.stride(0) == qkv.shape[1])
    elif layout == "padded":  # head stride != head size
        x = torch.randn(t, heads, d + 16, generator=gen).to(dtype).to(device)[..., 8 : 8 + d]
    elif layout == "offset1":
        x = torch.randn(t * heads * d + 1, generator=gen).to(dtype).to(device)[1:].view(t, heads, d)
    else:
        x = torch.randn(t, heads, d, generator=gen).to(dtype).to(device)
    # tables as RotaryEmbedding builds them, gathered at random positions
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 4096, (t,), generator=gen).float()
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    if layout == "padded":  # strided tables too
        cos = torch.cat([cos, cos], dim=-1)[:, :d]
        sin = torch.cat([sin, sin], dim=-1)[:, :d]
    return x, cos, sin


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("t,head_size,layout", ROTARY_CASES)
def test_rotary(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype, t: int,
                head_size: int, layout: str) -> None:
    ops, device = _backend(request, fixture)
    gen = torch.Generator().manual_seed(t * head_size)
    x, cos, sin = _rotary_inputs(t, head_size, layout, dtype, device, gen)
    _poison_allocator(device, x.numel())
    out = ops.rotary(x, cos, sin)
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == dtype

    assert _same_bits(out, reference.rotary(x, cos, sin))  # same rounding points, every dtype
    half = head_size // 2
    x64, c64, s64 = x.cpu().double(), cos.cpu().double()[:, None], sin.cpu().double()[:, None]
    rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    expected = x64 * c64 + rotated * s64
    _assert_f64_close(out, expected, (x64 * c64).abs() + (rotated * s64).abs(), dtype, "rotary")


# ---- silu_and_mul -----------------------------------------------------------------------------

SILU_CASES = [(1, 14336, "contiguous"), (7, 4096, "strided"), (37, 200, "contiguous"),
              (37, 72, "strided"), (7, 13, "offset1")]


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("t,inter,layout", SILU_CASES)
def test_silu_and_mul(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype, t: int,
                      inter: int, layout: str) -> None:
    ops, device = _backend(request, fixture)
    gen = torch.Generator().manual_seed(t + inter)
    x = _rows(t, 2 * inter, layout, dtype, device, gen, scale=3.0)
    x[0, :6] = torch.tensor([0.0, -0.0, 20.0, -20.0, 88.0, -88.0], dtype=dtype)  # exp near overflow
    _poison_allocator(device, t * inter)
    out = ops.silu_and_mul(x)
    assert out.shape == (t, inter) and out.is_contiguous() and out.dtype == dtype

    gate, up = x.cpu().double()[:, :inter], x.cpu().double()[:, inter:]
    expected = gate / (1 + torch.exp(-gate)) * up
    _assert_f64_close(out, expected, expected.abs(), dtype, "silu_and_mul", floor=1 + up.abs())
    if dtype in HALF_DTYPES:
        ref = reference.silu_and_mul(x)
        if fixture == "cuda_ops":  # torch's silu is x / (1 + expf(-x)) in float, as the kernel's
            assert _same_bits(out, ref)
        else:  # the reference rounds silu(gate) to the dtype, then * up
            up_dev = x[:, inter:]
            _assert_one_step(out, F.silu(x[:, :inter]), lambda v: v.to(device) * up_dev,
                             "silu_and_mul vs torch")


# ---- edge cases and wiring --------------------------------------------------------------------


@pytest.mark.parametrize("fixture", BACKENDS)
def test_zero_tokens(request: pytest.FixtureRequest, fixture: str) -> None:
    ops, device = _backend(request, fixture)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    w = torch.ones(64, dtype=torch.bfloat16, device=device)
    normed, residual = ops.rms_norm(x, w, 1e-6, x)
    assert normed.shape == residual.shape == (0, 64)
    assert ops.rotary(x.view(0, 1, 64), x, x).shape == (0, 1, 64)
    assert ops.silu_and_mul(x).shape == (0, 32)


def test_layer_ops_dispatch_by_dtype(emu_ops: ModuleType) -> None:
    """16-bit tensors go to the kernels, float32 to the torch reference (bit for bit)."""
    from pagedllm.backends.cuda.layer_ops import layer_ops

    calls: list[str] = []

    def recording(name: str) -> Callable[..., object]:
        def fn(*args: object) -> object:
            calls.append(name)
            return getattr(emu_ops, name)(*args)
        return fn

    kernels = SimpleNamespace(**{n: recording(n) for n in ("rms_norm", "rotary", "silu_and_mul")})
    table = layer_ops(kernels)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x, w = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
        got = [table["rms_norm"](x, w, 1e-6, x)[0], table["rotary"](x.view(3, 1, 64), x, x),
               table["silu_and_mul"](x)]
        want = [reference.rms_norm(x, w, 1e-6, x)[0], reference.rotary(x.view(3, 1, 64), x, x),
                reference.silu_and_mul(x)]
        if dtype == torch.float32:
            assert not calls and all(_same_bits(g, r) for g, r in zip(got, want))
        else:
            assert calls == ["rms_norm", "rotary", "silu_and_mul"]
            calls.clear()


def test_register_ops_keeps_the_reference_without_kernels(monkeypatch: pytest.MonkeyPatch,
                                                          emu_ops: ModuleType) -> None:
    from pagedllm.backends.cuda import ops as kernel_ops
    from pagedllm.backends.cuda.backend import CudaBackend
    from pagedllm.models.layers.ops import Ops

    def registered(backend: CudaBackend) -> list[str]:
        ops = Ops()
        backend.register_ops(ops)
        return [n for n in ("rms_norm", "rotary", "silu_and_mul")
                if getattr(ops, n) is not getattr(reference, n)]

    monkeypatch.setattr(kernel_ops, "kernels_available", lambda build=False: (False, "test"))
    assert registered(CudaBackend()) == []
    monkeypatch.setattr(kernel_ops, "kernels_available", lambda build=False: (True, "test"))
    monkeypatch.setattr(kernel_ops, "load_kernels", lambda: emu_ops)
    assert registered(CudaBackend()) == ["rms_norm", "rotary", "silu_and_mul"]
    opted_out = CudaBackend()
    opted_out.layer_kernels = False  # what check_and_update_config sets for attention_backend=torch
    assert registered(opted_out) == []


# ---- argument checking (GPU only), by the Python wrappers ----------------------------------------
# (The C++ binding repeats the checks, but on the H200 machine an exception thrown by a failing
# TORCH_CHECK crashed the process instead of raising; see backends/cuda/checks.py.)


def _bad_calls(ops: ModuleType) -> list[tuple[str, Callable[[], object]]]:
    x = torch.randn(4, 64, dtype=torch.float16, device="cuda")
    w = torch.ones(64, dtype=torch.float16, device="cuda")
    x3 = x.view(4, 2, 32)
    cs = torch.ones(4, 32, dtype=torch.float16, device="cuda")
    return [
        ("weight", lambda: ops.rms_norm(x, w.float(), 1e-6)),
        ("weight", lambda: ops.rms_norm(x, w[:32], 1e-6)),
        ("residual", lambda: ops.rms_norm(x, w, 1e-6, x[:2])),
        ("residual", lambda: ops.rms_norm(x, w, 1e-6, x.cpu())),
        ("x", lambda: ops.rms_norm(x.cpu(), w.cpu(), 1e-6)),
        ("x", lambda: ops.rms_norm(x3, w, 1e-6)),
        ("x", lambda: ops.rms_norm(x.int(), w, 1e-6)),
        ("eps", lambda: ops.rms_norm(x, w, -1.0)),
        ("x", lambda: ops.rms_norm(x.t(), w, 1e-6)),
        ("cos", lambda: ops.rotary(x3, cs[:, :16], cs)),
        ("sin", lambda: ops.rotary(x3, cs, cs.bfloat16())),
        ("sin", lambda: ops.rotary(x3, cs, cs.cpu())),
        ("head_size", lambda: ops.rotary(x[:, :63].reshape(4, 1, 63), cs, cs)),
        ("x", lambda: ops.rotary(x, cs, cs)),
        ("x", lambda: ops.silu_and_mul(x[:, :63])),
        ("x", lambda: ops.silu_and_mul(x[0])),
        ("x", lambda: ops.silu_and_mul(x.double())),
        ("x", lambda: ops.silu_and_mul(x.t())),
    ]


def test_bad_arguments_raise(cuda_ops: ModuleType) -> None:
    for name, call in _bad_calls(cuda_ops):
        with pytest.raises(RuntimeError, match=rf"\b{name}\b"):
            call()
