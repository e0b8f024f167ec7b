"""The GEMV's prologues (csrc/gemv_kernels.cu): rms_norm or silu_and_mul applied to x inside the
GEMV equal the rms_norm / silu_and_mul kernel followed by the GEMV, bit for bit (same roundings and
summation order), and the cuda backend's fused ops route one-token inputs to them. Needs a GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from test_gemv import HALF_DTYPES, _assert_matches_f64, _dtype_id, _poison_allocator

# (out_features, in_features): Llama-3-8B's qkv / gate_up inputs (K 4096), an uneven row split
# with K of one partial pass, the smallest K, and fewer rows than SMs.
SHAPES = [(6144, 4096), (6144 + 77, 1024), (37, 8), (300, 2048)]


@pytest.fixture(scope="module")
def kernels(cuda_ops):
    kernels = cuda_ops.load_kernels()
    if not hasattr(kernels, "gemv_rms_norm"):
        pytest.fail("the kernel module has no gemv_rms_norm: stale build?")
    return kernels


def _tensors(seed: int, dtype: torch.dtype, *shapes, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=gen) * scale).to(dtype).cuda() for s in shapes]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["x", "x+residual"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_rms_norm_equals_rms_norm_then_gemv(kernels, n: int, k: int, dtype: torch.dtype,
                                                 with_residual: bool, bias: bool) -> None:
    x, residual, norm_w = _tensors(n + k, dtype, (1, k), (1, k), (k,))
    (w,) = _tensors(n * k, dtype, (n, k), scale=k ** -0.5)
    b = _tensors(7, dtype, (n,))[0] if bias else None
    residual = residual if with_residual else None
    _poison_allocator(n * 4, k * 4)
    got, got_residual = kernels.gemv_rms_norm(x, residual, norm_w, 1e-5, w, b)
    h, want_residual = kernels.rms_norm(x, norm_w, 1e-5, residual)
    assert torch.equal(got_residual, want_residual)
    if with_residual:
        assert got_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    assert torch.equal(got, kernels.gemv(h, w, b)), "fused rms_norm differs from the kernels"
    _assert_matches_f64(got, h, w, b, dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n,k", [(4096, 14336), (1000, 1024), (5, 8)])
def test_gemv_silu_and_mul_equals_silu_and_mul_then_gemv(kernels, n: int, k: int,
                                                         dtype: torch.dtype, bias: bool) -> None:
    (x,) = _tensors(k, dtype, (1, 2 * k), scale=3.0)
    (w,) = _tensors(n + k, dtype, (n, k), scale=k ** -0.5)
    b = _tensors(5, dtype, (n,))[0] if bias else None
    _poison_allocator(n * 4)
    got = kernels.gemv_silu_and_mul(x, w, b)
    act = kernels.silu_and_mul(x)
    assert torch.equal(got, kernels.gemv(act, w, b)), "fused silu_and_mul differs from the kernels"
    _assert_matches_f64(got, act, w, b, dtype)


def test_gemv_prologues_in_a_cuda_graph(kernels) -> None:
    """Inside a graph, behind the kernel that writes their input (programmatic launch)."""
    x, residual, norm_w = _tensors(3, torch.bfloat16, (1, 4096), (1, 4096), (4096,))
    w, w_down = _tensors(4, torch.bfloat16, (2 * 3072, 4096), (4096, 3072), scale=0.02)
    src = torch.zeros_like(x)

    def body():
        h = src * 2  # a torch kernel writes x; ours follow it
        gate_up, res = kernels.gemv_rms_norm(h, residual, norm_w, 1e-5, w)
        return kernels.gemv_silu_and_mul(gate_up, w_down), res

    src.copy_(x)
    want = [t.clone() for t in body()]
    graph = torch.cuda.CUDAGraph()
    src.zero_()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outs = body()
    src.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, t) for o, t in zip(outs, want))


def test_gemv_prologues_reject_bad_arguments(kernels) -> None:
    x, norm_w = _tensors(1, torch.bfloat16, (1, 64), (64,))
    (w,) = _tensors(2, torch.bfloat16, (32, 64))
    with pytest.raises(RuntimeError, match="norm_weight must have shape"):
        kernels.gemv_rms_norm(x, None, norm_w[:32].contiguous(), 1e-5, w)
    with pytest.raises(RuntimeError, match="residual must have shape"):
        kernels.gemv_rms_norm(x, x[:, :32].contiguous(), norm_w, 1e-5, w)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        kernels.gemv_rms_norm(x, None, norm_w, float("nan"), w)
    with pytest.raises(RuntimeError, match=r"weight must be \[out_features, 32\] for x of 64"):
        kernels.gemv_silu_and_mul(x, w)


def test_fused_ops_route_one_token_inputs_to_the_gemv(kernels) -> None:
    from pagedllm.backends.cuda.layer_ops import layer_ops

    ops = layer_ops(kernels)
    if kernels.kernel_arch() < 900:
        assert "rms_norm_linear" not in ops and "silu_and_mul_linear" not in ops
        return
    x, residual, norm_w = _tensors(11, torch.bfloat16, (1, 1024), (1, 1024), (1024,))
    (w,) = _tensors(12, torch.bfloat16, (300, 1024), scale=0.03)
    layer = SimpleNamespace(weight=w, bias=None)
    got = ops["rms_norm_linear"](x, norm_w, 1e-6, residual, layer)
    want = kernels.gemv_rms_norm(x, residual, norm_w, 1e-6, w)
    assert all(torch.equal(g, t) for g, t in zip(got, want))
    x2, r2 = torch.cat([x, x * 0.5]), torch.cat([residual, residual])
    h2, res2 = kernels.rms_norm(x2, norm_w, 1e-6, r2)  # two tokens: the two ops, cuBLAS
    got2 = ops["rms_norm_linear"](x2, norm_w, 1e-6, r2, layer)
    assert torch.equal(got2[0], F.linear(h2, w)) and torch.equal(got2[1], res2)
    (gu,) = _tensors(13, torch.bfloat16, (1, 608))
    down = SimpleNamespace(weight=_tensors(14, torch.bfloat16, (1024, 304))[0], bias=None)
    assert torch.equal(ops["silu_and_mul_linear"](gu, down),
                       kernels.gemv_silu_and_mul(gu, down.weight))
