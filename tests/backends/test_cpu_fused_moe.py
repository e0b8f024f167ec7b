"""The cpu backend's fused_moe (backends/cpu/fused_moe.py): experts packed once after loading,
against the per-expert torch reference (moe_ops.fused_moe) in float32 and bfloat16 on every linear
route (oneDNN native / float32 compute, MKL); the C++ op (csrc/cpu/fused_moe_cpu.cpp) bit-equal
to the Python loop over the same packs, serial and with the experts in parallel; the Python loop
where the kernels do not load; the unpacked weights released after packing; the fallback for
unpacked weights; the wiring through Ops and the model loader (Mixtral's and Qwen3-MoE's token
equality with transformers runs on this path: tests/models/test_mixtral.py, test_qwen3_moe.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu import fused_moe as cpu_moe
from pagedllm.backends.cpu import ops as cpu_ops
from pagedllm.backends.cpu.kernels import load_cpu_kernels
from pagedllm.models.layers.moe import FusedExperts
from pagedllm.models.layers.moe_ops import fused_moe, fused_moe_grouped


class _Tp:
    size, rank = 1, 0

    @staticmethod
    def shard(n: int, what: str) -> int:
        return n


class _Ctx:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.device, self.tp = dtype, torch.device("cpu"), _Tp()


def _experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> FusedExperts:
    experts = FusedExperts(e, h, i, _Ctx(dtype))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w13.weight.copy_(torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5)
        experts.w2.weight.copy_(torch.randn(e, h, i, generator=gen) / i ** 0.5)
    return experts


def _inputs(tokens: int, h: int, e: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, h, generator=gen).to(dtype),
            torch.randn(tokens, e, generator=gen).to(dtype))


def _op(hidden: torch.Tensor, w13: torch.Tensor, logits: torch.Tensor, topk: int,
        renormalize: bool, parallel: bool) -> torch.Tensor:
    w = getattr(w13, cpu_moe.OP_WEIGHTS)
    return load_cpu_kernels().fused_moe_packed(hidden, logits, topk, renormalize, w.up, w.down,
                                               w.up_origin, w.down_origin, w.route, w.compute,
                                               w.inter, parallel)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens,topk,renormalize", [(1, 2, True), (9, 2, True), (40, 3, False)])
def test_packed_experts_match_the_reference(dtype: torch.dtype, tol: float, tokens: int,
                                            topk: int, renormalize: bool) -> None:
    """Every routed (token, expert) pair through the packed GEMMs: the same sum as the
    reference within the GEMMs' accumulation order (float32) or a bf16 rounding or two."""
    experts = _experts(8, 64, 96, dtype, tokens)
    ref13, ref2 = experts.w13.weight.detach().clone(), experts.w2.weight.detach().clone()
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    assert len(getattr(w13, cpu_moe.PACKED)) == 8 and len(getattr(w2, cpu_moe.PACKED)) == 8
    x, logits = _inputs(tokens, 64, 8, dtype, 100 + tokens)
    got = cpu_moe.fused_moe(x, w13, w2, logits, topk, renormalize)
    want = fused_moe(x, ref13, ref2, logits, topk, renormalize)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a wrong routing weight or a dropped pair is far outside that
    wrong = fused_moe(x, ref13, ref2, logits, topk, not renormalize) if topk < 8 else want * 2
    assert not torch.allclose(got.float(), wrong.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fp32,half", [(None, None), ("onednn", "native"),
                                       ("mkl", "float32")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_python_loop_on_every_route(route, fp32: str | None, half: str | None,
                                                  dtype: torch.dtype) -> None:
    """The C++ op computes run_grouped's arithmetic on the same packs: bit-equal to the Python
    loop (serially on every route; with the experts in parallel on oneDNN's), and within a
    rounding of the reference on the original weights."""
    route(fp32, half)
    experts = _experts(6, 48, 80, dtype, 3)
    ref13, ref2 = experts.w13.weight.detach().clone(), experts.w2.weight.detach().clone()
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    weights = getattr(w13, cpu_moe.OP_WEIGHTS)
    assert weights is not None
    mkl = dtype == torch.float32 and cpu_ops.fp32_linear_route() == "mkl"  # timed when None
    assert weights.route == (cpu_moe.ROUTE_MKL if mkl else cpu_moe.ROUTE_ONEDNN)
    assert mkl or fp32 != "mkl" or dtype != torch.float32
    for tokens, topk, renormalize in ((0, 2, True), (1, 1, True), (7, 2, True), (70, 3, False)):
        x, logits = _inputs(tokens, 48, 6, dtype, tokens)
        python = cpu_moe.fused_moe_python(x, w13, w2, logits, topk, renormalize)
        assert torch.equal(_op(x, w13, logits, topk, renormalize, False), python)
        if weights.route == cpu_moe.ROUTE_ONEDNN:
            assert torch.equal(_op(x, w13, logits, topk, renormalize, True), python)
        got = cpu_moe.fused_moe(x, w13, w2, logits, topk, renormalize)
        assert torch.equal(got, python)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), fused_moe(x, ref13, ref2, logits, topk,
                                                          renormalize).float(),
                                   rtol=tol, atol=tol)


def test_parallel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """$PAGEDLLM_CPU_MOE_PARALLEL picks the op's schedule (same result either way)."""
    experts = _experts(4, 32, 48, torch.bfloat16, 7)
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    x, logits = _inputs(20, 32, 4, torch.bfloat16, 8)
    outs = []
    try:
        for value, want in (("0", False), ("1", True), ("", True)):
            monkeypatch.setenv(cpu_moe.PARALLEL_ENV, value)
            cpu_moe.parallel_experts.cache_clear()
            assert cpu_moe.parallel_experts() is want
            outs.append(cpu_moe.fused_moe(x, w13, w2, logits, 2, True))
        monkeypatch.setenv(cpu_moe.PARALLEL_ENV, "maybe")  # envs' on/off grammar refuses it
        cpu_moe.parallel_experts.cache_clear()
        with pytest.raises(ValueError, match=cpu_moe.PARALLEL_ENV + "='maybe' is invalid"):
            cpu_moe.parallel_experts()
    finally:
        monkeypatch.undo()
        cpu_moe.parallel_experts.cache_clear()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_python_loop_where_the_kernels_do_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = _experts(4, 32, 48, torch.bfloat16, 5)
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    x, logits = _inputs(9, 32, 4, torch.bfloat16, 6)
    with_op = cpu_moe.fused_moe(x, w13, w2, logits, 2, True)
    monkeypatch.setattr(cpu_moe, "optional_cpu_kernels", lambda purpose, library: False)
    loop = cpu_moe.fused_moe(x, w13, w2, logits, 2, True)
    assert torch.equal(loop, with_op)
    assert torch.equal(loop, cpu_moe.fused_moe_python(x, w13, w2, logits, 2, True))


def test_op_rejects_bad_arguments() -> None:
    experts = _experts(4, 32, 48, torch.float32, 0)
    cpu_moe.fused_moe_prepare(experts)
    w13 = experts.w13.weight
    x, logits = _inputs(3, 32, 4, torch.float32, 0)
    with pytest.raises(RuntimeError, match="topk=5"):
        _op(x, w13, logits, 5, True, False)
    with pytest.raises(RuntimeError, match="one packed up and down weight per expert"):
        _op(x, w13, torch.randn(3, 5), 2, True, False)
    with pytest.raises(RuntimeError, match="hidden dtype must be float32, bfloat16 or float16"):
        _op(x.double(), w13, logits, 2, True, False)


def _resident(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("fp32,half,dtype", [(None, None, torch.float32),
                                             (None, None, torch.bfloat16),
                                             ("mkl", None, torch.float32)])
def test_prepare_releases_the_unpacked_weights(route, fp32: str | None, half: str | None,
                                               dtype: torch.dtype) -> None:
    """Once the cpu op has run on the packs, only the packs hold the experts: w13 / w2 keep shape
    and dtype with no storage behind them, and the layer still computes from the packs. Until
    then the reference op (swapped in after the backend's registration) still reads them."""
    route(fp32, half)
    experts = _experts(4, 32, 48, dtype, 1)
    ref13, ref2 = experts.w13.weight.detach().clone(), experts.w2.weight.detach().clone()
    before = _resident(experts.w13.weight) + _resident(experts.w2.weight)
    cpu_moe.fused_moe_prepare(experts)
    w13, w2 = experts.w13.weight, experts.w2.weight
    x, logits = _inputs(5, 32, 4, dtype, 2)
    want = fused_moe(x, ref13, ref2, logits, 2, True)
    assert torch.equal(fused_moe(x, w13, w2, logits, 2, True), want)
    assert not getattr(w13, cpu_moe.RELEASED, False)
    first = cpu_moe.fused_moe(x, w13, w2, logits, 2, True)
    w13, w2 = experts.w13.weight, experts.w2.weight
    assert getattr(w13, cpu_moe.RELEASED) and getattr(w2, cpu_moe.RELEASED)
    assert w13.shape == ref13.shape and w2.shape == ref2.shape and w13.dtype == dtype
    assert before == (ref13.numel() + ref2.numel()) * ref13.element_size()
    assert _resident(w13) + _resident(w2) <= 2 * 4  # one element each
    assert all(p.weight is None or _resident(p.weight) <= 4
               for p in getattr(w13, cpu_moe.PACKED) + getattr(w2, cpu_moe.PACKED))
    cpu_moe.fused_moe_prepare(experts)  # a second call keeps the packs (no NaNs packed)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for run in (cpu_moe.fused_moe, cpu_moe.fused_moe_python):
        got = run(x, w13, w2, logits, 2, True)
        assert torch.equal(got, first) and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="released"):
        cpu_moe.fused_moe(x.to(other), w13, w2, logits, 2, True)


def test_keep_unpacked_weights_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_moe.KEEP_UNPACKED_ENV, "1")
    experts = _experts(4, 32, 48, torch.float32, 1)
    ref13 = experts.w13.weight.detach().clone()
    cpu_moe.fused_moe_prepare(experts)
    x, logits = _inputs(3, 32, 4, torch.float32, 0)
    cpu_moe.fused_moe(x, experts.w13.weight, experts.w2.weight, logits, 2, True)
    assert not getattr(experts.w13.weight, cpu_moe.RELEASED, False)
    assert torch.equal(experts.w13.weight, ref13)
    monkeypatch.setenv(cpu_moe.KEEP_UNPACKED_ENV, "maybe")  # not an on/off value (envs.py)
    with pytest.raises(ValueError, match=cpu_moe.KEEP_UNPACKED_ENV):
        cpu_moe.fused_moe_prepare(_experts(2, 16, 16, torch.float32, 0))


def test_unpacked_weights_take_the_grouped_path() -> None:
    experts = _experts(4, 32, 48, torch.float32, 0)
    w13, w2 = experts.w13.weight, experts.w2.weight
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(cpu_moe.fused_moe(x, w13, w2, logits, 2, True),
                       fused_moe_grouped(x, w13, w2, logits, 2, True))
    with pytest.raises(ValueError, match="fused_moe"):
        cpu_moe.fused_moe(x, w13, w2, logits, 5, True)


def test_cpu_backend_registers_packed_moe() -> None:
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.layers.ops import Ops

    ops = Ops()
    assert "fused_moe_prepare" in Ops.NAMES
    ops.fused_moe_prepare(_experts(2, 16, 16, torch.float32, 0))  # the reference: a no-op
    CpuBackend().register_ops(ops)
    assert ops.fused_moe is cpu_moe.fused_moe
    assert ops.fused_moe_prepare is cpu_moe.fused_moe_prepare


def test_loader_prepares_the_experts(checkpoint_factory) -> None:
    """LLM(...) on a Mixtral checkpoint packs every MoE block's experts; once the model has run,
    their unpacked weights are gone."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(checkpoint_factory("mixtral"), device="cpu", dtype="float32")
    blocks = [m for m in llm.llm_engine.executor.worker.model.modules()
              if isinstance(m, FusedExperts)]
    assert blocks and all(hasattr(b.w13.weight, cpu_moe.PACKED) for b in blocks)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    assert all(getattr(b.w13.weight, cpu_moe.RELEASED, False)
               and b.w2.weight.untyped_storage().nbytes() <= 4 for b in blocks)
