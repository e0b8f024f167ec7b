"""The few-rows linear route (backends/cpu/few_rows.py, csrc/cpu/few_rows_linear_cpu.cpp): the
kernel equals a float64 reference at 1..8 rows, every padding of its column blocks, with and
without bias; only layers of a few-rows model (a proposer) get its copy, and ``linear`` takes it
at 1..8 rows and the GEMM above; bad input is refused by name."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.backends.cpu import few_rows, ops
from pagedllm.reference.ops import Ops
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.models.layers.linear import LayerContext, ReplicatedLinear


@pytest.fixture
def route(monkeypatch, cpu_kernels):
    """Sets PAGEDLLM_CPU_FEW_ROWS_LINEAR (on / off) with a fresh cached choice."""
    def set_route(value: str) -> None:
        monkeypatch.setenv(few_rows.FEW_ROWS_ENV, value)
        few_rows.few_rows_route.cache_clear()
    yield set_route
    few_rows.few_rows_route.cache_clear()


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (100, 37), (384, 768), (17, 5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(cpu_kernels, out_features: int, in_features: int,
                                          bias: bool, weight_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(weight_dtype).double()
    b = torch.randn(out_features, generator=gen, dtype=torch.float64) if bias else None
    packed = cpu_kernels.few_rows_linear_pack(w.to(weight_dtype))
    assert packed.dtype == weight_dtype
    block = cpu_kernels.few_rows_linear_block()
    assert packed.shape == (-(-out_features // block), in_features, block)
    for rows in range(1, 9):
        x = torch.randn(rows, in_features, generator=gen, dtype=torch.float64)
        y = cpu_kernels.few_rows_linear(x.float(), packed, b.float() if bias else None,
                                        out_features)
        ref = x @ w.T + (b if bias else 0)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        err = (y.double() - ref).norm() / ref.norm()
        assert err < 1e-6, (rows, err)


def _layer(few: bool, dtype: torch.dtype = torch.float32, bias: bool = True) -> ReplicatedLinear:
    ctx = LayerContext(ops=Ops(), tp=TPGroup(), dtype=dtype, device=torch.device("cpu"),
                       attn_cls=object, few_rows=few)
    layer = ReplicatedLinear(48, 80, bias, ctx)
    gen = torch.Generator().manual_seed(3)
    layer.weight.data.copy_(torch.randn(80, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(80, generator=gen))
    return layer


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_few_rows_layer_takes_the_kernel_at_up_to_8_rows(route, dtype, tol) -> None:
    route("on")
    layer = _layer(True, dtype)
    weight, bias = layer.weight.data.double().clone(), layer.bias.data.double().clone()
    ops.linear_prepare(layer)
    # bf16 values (a bf16 layer's) are packed as bf16: lossless; random float32 ones are not
    assert layer.few_rows_weight.dtype == (torch.bfloat16 if dtype == torch.bfloat16
                                           else torch.float32)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 5, 8, 9, 64):
        x = torch.randn(rows, 48, generator=gen).to(dtype)
        y = ops.linear(x, layer)
        ref = x.double() @ weight.T + bias
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()) < tol, rows
    # the copy is what 1..8 rows read, the GEMM what more rows read: a zeroed copy shows
    layer.few_rows_weight.zero_()
    layer.few_rows_bias.zero_()
    x = torch.randn(9, 48, generator=gen).to(dtype)
    assert not ops.linear(x[:8], layer).any()
    assert ops.linear(x, layer).abs().sum() > 0
    assert ops.linear(x[None, :3], layer).shape == (1, 3, 80)  # leading dims kept


def test_a_float32_layer_of_bf16_values_streams_half_the_bytes(route) -> None:
    """A bf16 checkpoint loaded into a float32 model: its copy is bf16 and computes the same
    values as the float32 copy would (every weight exact, float32 products and sums)."""
    route("on")
    layer = _layer(True, torch.float32)
    layer.weight.data.copy_(layer.weight.data.bfloat16().float())
    wide = torch.ops.pagedllm_cpu.few_rows_linear_pack(layer.weight.data.clone())
    ops.linear_prepare(layer)
    assert layer.few_rows_weight.dtype == torch.bfloat16
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
    want = torch.ops.pagedllm_cpu.few_rows_linear(x, wide, layer.few_rows_bias, 80)
    assert torch.equal(ops.linear(x, layer), want)


def test_only_few_rows_models_get_the_copy(route) -> None:
    route("on")
    target = _layer(False)
    ops.linear_prepare(target)
    assert not hasattr(target, "few_rows_weight")  # a target's linears: never a second copy
    route("off")
    proposer = _layer(True)
    ops.linear_prepare(proposer)
    assert not hasattr(proposer, "few_rows_weight")


def test_bad_input_is_refused_by_name(cpu_kernels) -> None:
    packed = cpu_kernels.few_rows_linear_pack(torch.randn(64, 16))
    with pytest.raises(RuntimeError, match=r"rows=9 is outside 1\.\.8"):
        cpu_kernels.few_rows_linear(torch.randn(9, 16), packed, None, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        cpu_kernels.few_rows_linear(torch.randn(2, 16).double(), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features=65 does not match the packing"):
        cpu_kernels.few_rows_linear(torch.randn(2, 16), packed, None, 65)
    with pytest.raises(RuntimeError, match="weight must be float32 or bfloat16"):
        cpu_kernels.few_rows_linear_pack(torch.randn(64, 16).half())


def test_a_proposer_runs_its_linears_on_the_route(route, llama_path: str) -> None:
    """The draft model an engine loads is a few-rows model (its layers carry the copy), the
    target is not; greedy output with the draft equals the output without it."""
    route("on")
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[1, 5, 9, 13, 5, 9, 13, 5], [7, 3, 3, 8]]
    llm = LLM(llama_path, device="cpu", dtype="float32", kv_cache_space_gib=0.05,
              distributed_executor_backend="uni",
              speculative_config={"model": llama_path, "num_speculative_tokens": 3})
    worker = llm.llm_engine.executor.worker
    draft = [m for m in worker.proposer.model.modules() if hasattr(m, "packed_weight")
             or hasattr(m, "mkl_weight")]
    assert draft and all(hasattr(m, "few_rows_weight") for m in draft)
    assert not any(hasattr(m, "few_rows_weight") for m in worker.model.modules())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.stepper.metrics.num_accepted_tokens > 0
    del llm
    plain = LLM(llama_path, device="cpu", dtype="float32", kv_cache_space_gib=0.05)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
