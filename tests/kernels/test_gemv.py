"""The one-token GEMV (csrc/gemv_kernels.cu) against a float64 reference, and its wiring as the
cuda backend's ``linear`` op (pagedllm/backends/cuda/layer_ops.py). Needs a GPU.

Tolerance: the output is rounded once to the dtype (half an ulp of the result) after a float32
accumulation over K products (a few float32 ulps of sum |w x|).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
# (out_features, in_features): Llama-3-8B's o_proj / down shapes cut down, odd row counts that
# leave thread blocks uneven, K that is not a multiple of the 2,048 elements one pass of the
# block covers, and fewer rows than SMs.
SHAPES = [(4096, 4096), (1000, 14336), (6144 + 77, 1024), (513, 520), (37, 8), (7, 16384)]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@pytest.fixture(scope="module")
def kernels(cuda_ops):
    return cuda_ops.load_kernels()


def _poison_allocator(*numels: int) -> None:
    blocks = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for n in numels]
    blocks.clear()


def _operands(n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(dtype).cuda()
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).cuda()
    b = torch.randn(n, generator=gen).to(dtype).cuda() if bias else None
    return x, w, b


def _assert_matches_f64(got, x, w, b, dtype) -> None:
    ref = w.double() @ x.double()[0]
    if b is not None:
        ref = ref + b.double()
    mag = w.double().abs() @ x.double().abs()[0] + (b.double().abs() if b is not None else 0)
    got = got.double()[0]
    assert not got.isnan().any(), "NaN in the output: a row was not written"
    tol = torch.finfo(dtype).eps * ref.abs() + 32 * torch.finfo(torch.float32).eps * mag + 1e-6
    err = (got - ref).abs()
    assert (err <= tol).all(), f"max error / tolerance {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "direct"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64(kernels, n: int, k: int, dtype: torch.dtype, bias: bool,
                              staged: bool) -> None:
    x, w, b = _operands(n, k, dtype, n * 31 + k, bias)
    _poison_allocator(n)
    got = kernels.gemv(x, w, b, staged)
    assert got.shape == (1, n) and got.dtype == dtype
    _assert_matches_f64(got, x, w, b, dtype)
    # and the same rows as cuBLAS up to the float32 summation order
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


def test_gemv_in_a_cuda_graph_after_other_kernels(kernels) -> None:
    """Captured behind a kernel that writes x (the GEMV reads x only after waiting for it), with
    a kernel after it that reads the output: replays follow new inputs."""
    x, w, b = _operands(4096, 4096, torch.bfloat16, 5, True)
    src = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = kernels.silu_and_mul(torch.cat([src, src], dim=1) + 1)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            h = kernels.silu_and_mul(torch.cat([src, src], dim=1))  # h = silu(src) * src
            y = kernels.gemv(h, w, b)
            out = y * 2
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        src.copy_(torch.randn(src.shape, generator=torch.Generator().manual_seed(seed)).to(src))
        graph.replay()
        torch.cuda.synchronize()
        h_ref = kernels.silu_and_mul(torch.cat([src, src], dim=1))
        assert torch.equal(out, kernels.gemv(h_ref, w, b) * 2)


def test_gemv_rejects_bad_arguments(kernels) -> None:
    x, w, _ = _operands(64, 64, torch.bfloat16, 1, False)
    with pytest.raises(RuntimeError, match="x must be float16 or bfloat16"):
        kernels.gemv(x.float(), w.float())
    with pytest.raises(RuntimeError, match=r"x must be \[1, in_features\]"):
        kernels.gemv(torch.cat([x, x]), w)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.gemv(x, w[:, :32].contiguous())
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 8"):
        kernels.gemv(x[:, :60].contiguous(), w[:, :60].contiguous())
    with pytest.raises(RuntimeError, match="bias must have shape"):
        kernels.gemv(x, w, torch.zeros(63, dtype=x.dtype, device="cuda"))


def test_linear_op_routes_one_token_inputs_to_the_gemv(kernels) -> None:
    from pagedllm.backends.cuda.layer_ops import layer_ops

    ops = layer_ops(kernels)
    if kernels.kernel_arch() < 900:
        assert "linear" not in ops  # cuBLAS everywhere before sm_90
        return
    x, w, b = _operands(300, 1024, torch.bfloat16, 9, True)
    layer = SimpleNamespace(weight=w, bias=b)
    assert torch.equal(ops["linear"](x, layer), kernels.gemv(x, w, b))
    x2 = torch.cat([x, x * 0.5])
    assert torch.equal(ops["linear"](x2, layer), F.linear(x2, w, b))
    x_odd = x[:, :1020].contiguous()  # K not a multiple of 8: cuBLAS
    layer_odd = SimpleNamespace(weight=w[:, :1020].contiguous(), bias=None)
    assert torch.equal(ops["linear"](x_odd, layer_odd), F.linear(x_odd, layer_odd.weight))
