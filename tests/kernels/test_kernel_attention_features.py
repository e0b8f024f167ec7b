"""Sliding window and logit soft-capping in the CUDA/HIP decode kernel (csrc/paged_attention.cuh)
and the Triton prefill (backends/cuda/triton_prefill.py), against a float64 masked reference.

The decode kernel runs on the GPU where there is one (``cuda``) and through the SIMT emulator on
the CPU (``emulated``); windows shorter than one partition, spanning several and covering whole
partitions (which the kernel skips and the reduce kernel leaves out) are all exercised. The Triton
prefill runs compiled on a GPU, else under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported, as test_triton_prefill.py does
    os.environ.setdefault("TRITON_INTERPRET", "1")
from kernel_reference import gather_context  # noqa: E402
from test_paged_attention import TOL, Case, make_inputs  # noqa: E402


def masked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
               window: int | None, cap: float | None) -> torch.Tensor:
    """float64. q [n, H, D] at positions start..start+n-1; k/v [start + n, kvH, D]; the query at
    position p sees keys j with j <= p and (no window or j > p - window)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    p = start + torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    hidden = j > p if window is None else (j > p) | (j <= p - window)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _decode_backends() -> list:
    return [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]


# (window, cap, partition size): a window inside one partition, across partition borders,
# one that drops whole partitions, one longer than every sequence; caps on and off
DECODE_FEATURES = [(5, None, 64), (70, None, 64), (130, 3.0, 64), (1, None, None),
                   (None, 2.0, None), (4096, None, 128), (33, 1.5, 256)]


@pytest.mark.parametrize("fixture", _decode_backends())
@pytest.mark.parametrize("window, cap, partition", DECODE_FEATURES)
def test_decode_kernel_window_and_soft_cap(request: pytest.FixtureRequest, fixture: str,
                                           window: int | None, cap: float | None,
                                           partition: int | None) -> None:
    ops = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    for case in (Case(torch.float32, 64, 16, 8, 2, (1, 6, 65, 300)),
                 Case(torch.bfloat16, 128, 32, 4, 4, (129, 40))):
        x = make_inputs(case, device, seed=(window or 0) + 7)
        kc, vc = x["kv_cache"][0], x["kv_cache"][1]
        scale = case.head_size ** -0.5
        out = torch.full_like(x["query"], float("nan"))
        ops.paged_attention(out, x["query"], kc, vc, case.num_kv_heads, scale, x["block_tables"],
                            x["seq_lens"], case.block_size, max(case.seq_lens),
                            partition_size=partition, sliding_window=window, soft_cap=cap)
        for i, n in enumerate(case.seq_lens):
            k = gather_context(kc, x["block_tables"][i], n)
            v = gather_context(vc, x["block_tables"][i], n)
            ref = masked_ref(x["query"][i:i + 1].cpu(), k, v, n - 1, scale, window, cap)[0]
            torch.testing.assert_close(out[i].cpu().double(), ref, rtol=TOL[case.dtype],
                                       atol=TOL[case.dtype], msg=lambda m: f"{case} seq {i}: {m}")


def test_decode_kernel_window_changes_the_result(emu_ops: ModuleType) -> None:
    case = Case(torch.float32, 64, 16, 4, 2, (200,))
    x = make_inputs(case, "cpu", seed=3)
    outs = []
    for window in (None, 50):
        out = torch.empty_like(x["query"])
        emu_ops.paged_attention(out, x["query"], x["kv_cache"][0], x["kv_cache"][1], 2, 0.125,
                                x["block_tables"], x["seq_lens"], 16, 200, sliding_window=window)
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


# ---- Triton prefill ---------------------------------------------------------------------------
PREFILL_FEATURES = [(3, None), (20, None), (None, 2.0), (9, 1.0), (1000, None)]


@pytest.mark.parametrize("window, cap", PREFILL_FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_prefill_window_and_soft_cap(window: int | None, cap: float | None,
                                            dtype: torch.dtype) -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    pytest.importorskip("triton")
    # no context (plain prefill), context ending mid-block, a long prefix with a short chunk
    _check_prefill([0, 21, 37], [19, 5, 17], dtype, (window or 0) + 1, window, cap)


def _check_prefill(context_lens: list[int], query_lens: list[int], dtype: torch.dtype, seed: int,
                   window: int | None, cap: float | None, **kwargs) -> None:
    """The Triton prefill (keyword arguments passed on) equals masked_ref for each sequence."""
    from test_triton_prefill import DEVICE, _make_case

    from pagedllm.backends.cuda.triton_prefill import context_attention_fwd

    case = _make_case(context_lens, query_lens, 4, 2, 64, 16, dtype, seed=seed)
    scale = 64 ** -0.5
    out = torch.full_like(case["q"], float("nan"))
    context_attention_fwd(case["q"], case["k"], case["v"], out, case["kv_cache_k"],
                          case["kv_cache_v"], case["block_tables"], case["query_start_loc"],
                          case["seq_lens"], case["context_lens"], scale, validate=True,
                          sliding_window=window, soft_cap=cap, **kwargs)
    starts = case["query_start_loc"].tolist()
    for i, ctx in enumerate(context_lens):
        s, e = starts[i], starts[i + 1]
        k = torch.cat([gather_context(case["kv_cache_k"], case["block_tables"][i], ctx),
                       case["k"][s:e].cpu()])
        v = torch.cat([gather_context(case["kv_cache_v"], case["block_tables"][i], ctx),
                       case["v"][s:e].cpu()])
        ref = masked_ref(case["q"][s:e].cpu(), k, v, ctx, scale, window, cap)
        torch.testing.assert_close(out[s:e].cpu().double(), ref, rtol=TOL[dtype], atol=TOL[dtype],
                                   msg=lambda m: f"seq {i} on {DEVICE}: {m}")


@pytest.mark.parametrize("window, cap", [(40, None), (300, 2.0), (None, 1.5)])
def test_triton_prefill_split_context_with_window_and_soft_cap(window: int | None,
                                                               cap: float | None) -> None:
    """The context split into ranges (issue 45) with a window that skips whole ranges, one that
    covers them all, and a soft cap."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    pytest.importorskip("triton")
    _check_prefill([0, 21, 300], [3, 5, 17], torch.float32, 7, window, cap, max_context_len=300,
                   num_splits=4)
