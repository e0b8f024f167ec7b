"""Registered model ops, swept like attention (issue 41, item 4): every op the backend registers
(or the reference it leaves in place) at row counts of 1, 37 and 263, widths of real models
that are not multiples of common tile widths (hidden 896 and 2880, intermediate 2752 and 11008,
an lm head of 32,000 rows, vocabularies of 32,000, 50,257 and 151,936), 8 to 128 experts with
top-1/2/8 routing, every optional argument (residual, bias, renormalize) and the layouts models
pass (partial rotary slices, row-strided logits), each against float64 on the same
dtype-rounded inputs. Which combinations run: space.py (pairs by default).
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.reference import ops as reference
from pagedllm.reference.ops import Ops
from pagedllm.testing.coverage import note
from pagedllm.testing.harness import tolerance, torch_dtype
from pagedllm.testing.space import Space

AREA = "model ops (sweep)"
# one matrix row for all of them; the report's shape coverage lists each op's cases
CAPABILITY_OF = {f"test_{op}_sweep": "model ops (sweep)" for op in (
    "rms_norm", "gemma_rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul", "linear",
    "greedy_logprobs", "apply_token_bitmask", "fused_moe")}
ROWS = (1, 37, 263)
HIDDEN = (64, 896, 2880, 5120)
INTERMEDIATE = (96, 2752, 11008)
LINEAR_SHAPES = ((96, 128), (3584, 896), (32000, 96))  # (out, in): odd, a Qwen2 block, an lm head
VOCABS = (32000, 50257, 151936)
EXPERTS, TOPK = (8, 60, 128), (1, 2, 8)
ROTARY = ("full", "partial")  # partial: the first half of each head, a strided slice


def _dims(caps: Capabilities, **dims: Any) -> Space:
    return Space({"dtype": list(caps.dtypes), **{k: list(v) for k, v in dims.items()}})


SPACES = {
    "test_rms_norm_sweep": lambda caps, *_: _dims(caps, rows=ROWS, width=HIDDEN,
                                                  residual=(False, True)),
    "test_gemma_rms_norm_sweep": lambda caps, *_: _dims(caps, rows=ROWS, width=HIDDEN,
                                                        residual=(False, True)),
    "test_rotary_sweep": lambda caps, *_: _dims(caps, rows=ROWS, head_size=sorted(caps.head_sizes),
                                                heads=(2, 11, 40), rotary=ROTARY),
    "test_silu_and_mul_sweep": lambda caps, *_: _dims(caps, rows=ROWS, width=INTERMEDIATE),
    "test_gelu_tanh_and_mul_sweep": lambda caps, *_: _dims(caps, rows=ROWS, width=INTERMEDIATE),
    "test_linear_sweep": lambda caps, *_: _dims(caps, rows=ROWS, shape=LINEAR_SHAPES,
                                                bias=(False, True)),
    "test_greedy_logprobs_sweep": lambda caps, *_: Space({"rows": [1, 37], "vocab": list(VOCABS),
                                                          "strided": [False, True]}),
    "test_apply_token_bitmask_sweep": lambda caps, *_: Space(
        {"rows": [1, 37], "vocab": list(VOCABS), "strided": [False, True]}),
    "test_fused_moe_sweep": lambda caps, *_: _dims(caps, rows=ROWS, experts=EXPERTS, topk=TOPK,
                                                   renormalize=(False, True)),
}


def backend_ops(backend: Backend) -> Ops:
    ops = Ops()
    backend.register_ops(ops)
    return ops


def _rng(case: dict[str, Any]) -> torch.Generator:
    """A generator seeded by the case (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(sorted(case.items())).encode()))


def close(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    """One rounding step of the dtype (4x its tolerance) of the float64 reference."""
    assert got.dtype == torch_dtype(dtype), f"{what}: returned {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != " \
                                                 f"{tuple(ref.shape)}"
    got = got.cpu().double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    tol = tolerance(dtype)
    bad = (got - ref).abs() > tol["atol"] * 4 + tol["rtol"] * 4 * ref.abs()
    if bad.any():
        at = [int(i) for i in torch.nonzero(bad)[0]]
        raise AssertionError(f"{what}: max |error| {(got - ref).abs().max().item():.3g} vs "
                             f"float64 reference; first bad element at {at}")


def _norm(op: str, backend: Backend, case: dict[str, Any], device: torch.device) -> None:
    rng, dt = _rng(case), torch_dtype(case["dtype"])
    rows, width = case["rows"], case["width"]
    x = torch.randn(rows, width, generator=rng).to(dt)
    w = (torch.randn(width, generator=rng) * (0.5 if op == "gemma_rms_norm" else 1.0)).to(dt)
    res = torch.randn(rows, width, generator=rng).to(dt) if case["residual"] else None
    eps = 1e-5 if rows % 2 else 1e-6
    fn = getattr(backend_ops(backend), op)
    normed, residual = fn(x.to(device), w.to(device), eps, None if res is None else res.to(device))
    ref_n, ref_r = getattr(reference, op)(x.double(), w.double(), eps,
                                          None if res is None else res.double())
    what = f"{op} rows {rows}, width {width}, residual {case['residual']}, eps {eps}"
    close(normed, ref_n, case["dtype"], what + " (normed)")
    close(residual, ref_r, case["dtype"], what + " (new residual)")
    note(rows=rows, width=width, residual=case["residual"])


def test_rms_norm_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                        conformance_device: torch.device) -> None:
    _norm("rms_norm", conformance_backend, sweep_case, conformance_device)


def test_gemma_rms_norm_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                              conformance_device: torch.device) -> None:
    _norm("gemma_rms_norm", conformance_backend, sweep_case, conformance_device)


def test_rotary_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                      conformance_device: torch.device) -> None:
    """q and k heads rotated together, neox style; ``partial``: only the first half of each head
    (a strided slice of it, as partial-rotary models pass it)."""
    case, dev = sweep_case, conformance_device
    rng, dt = _rng(case), torch_dtype(case["dtype"])
    t, d, heads = case["rows"], case["head_size"], case["heads"]
    rot = d if case["rotary"] == "full" else d // 2
    pos = (torch.arange(t, dtype=torch.float64) * 997 + 3)[:, None]  # positions up to ~262k
    freqs = pos * (10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot))[None, :]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)  # [T, rot]
    full = torch.randn(t, heads, d, generator=rng).to(dt)
    x = full[..., :rot]
    got = backend_ops(conformance_backend).rotary(x.to(dev) if rot == d else full.to(dev)[..., :rot],
                                                  cos.to(dt).to(dev), sin.to(dt).to(dev))
    ref = reference.rotary(x.double(), cos.to(dt).double(), sin.to(dt).double())
    close(got, ref, case["dtype"], f"rotary {t} tokens x {heads} heads x {d} (rotating {rot})")
    note(rows=t, heads=heads, head_size=d, rotary_dim=rot, strided=rot != d)


def _gated(op: str, backend: Backend, case: dict[str, Any], device: torch.device) -> None:
    rng, dt = _rng(case), torch_dtype(case["dtype"])
    x = (torch.randn(case["rows"], 2 * case["width"], generator=rng) * 2).to(dt)
    got = getattr(backend_ops(backend), op)(x.to(device))
    close(got, getattr(reference, op)(x.double()), case["dtype"],
          f"{op} rows {case['rows']}, width {case['width']}")
    note(rows=case["rows"], width=case["width"])


def test_silu_and_mul_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                            conformance_device: torch.device) -> None:
    _gated("silu_and_mul", conformance_backend, sweep_case, conformance_device)


def test_gelu_tanh_and_mul_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                                 conformance_device: torch.device) -> None:
    _gated("gelu_tanh_and_mul", conformance_backend, sweep_case, conformance_device)


def test_linear_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                      conformance_device: torch.device) -> None:
    case, dev = sweep_case, conformance_device
    rng, dt = _rng(case), torch_dtype(case["dtype"])
    out, inp = case["shape"]
    layer = nn.Module()
    weight = (torch.randn(out, inp, generator=rng) / inp ** 0.5).to(dt)
    bias = torch.randn(out, generator=rng).to(dt) if case["bias"] else None
    layer.weight = nn.Parameter(weight.to(dev), requires_grad=False)
    layer.bias = None if bias is None else nn.Parameter(bias.to(dev), requires_grad=False)
    x = torch.randn(case["rows"], inp, generator=rng).to(dt)
    ops = backend_ops(conformance_backend)
    ops.linear_prepare(layer)
    with torch.inference_mode():
        got = ops.linear(x.to(dev), layer)
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    close(got, ref, case["dtype"], f"linear {case['rows']} x {inp} -> {out}, bias {case['bias']}")
    note(rows=case["rows"], out_features=out, in_features=inp, bias=case["bias"])


def _logits(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [rows, vocab], the tensor to pass: the same or a row-strided view of it)."""
    rng = _rng(case)
    rows, vocab = case["rows"], case["vocab"]
    logits = torch.randn(rows, vocab, generator=rng) * 4
    logits[0, vocab - 1] = logits[0].max() + 1.0  # the winner in the last (partial) tile
    if rows > 2:  # an exact tie (the first index wins) and masked entries
        logits[1, 5] = logits[1, vocab - 3] = logits[1].max() + 1.0
        logits[2, : vocab // 2] = float("-inf")
    if not case["strided"]:
        return logits, logits.clone()
    wide = torch.zeros(rows, vocab + 72)
    wide[:, :vocab] = logits
    return logits, wide[:, :vocab]


def test_greedy_logprobs_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                               conformance_device: torch.device) -> None:
    logits, x = _logits(sweep_case)
    tokens, lp = backend_ops(conformance_backend).greedy_logprobs(x.to(conformance_device))
    what = f"greedy_logprobs {tuple(logits.shape)}, strided {sweep_case['strided']}"
    assert tokens.cpu().tolist() == logits.argmax(-1).tolist(), f"{what}: tokens"
    ref = logits.double().log_softmax(-1).gather(1, tokens.cpu()[:, None]).squeeze(1)
    err = (lp.cpu().double() - ref).abs().max().item()
    assert err < 1e-4, f"{what}: logprob error {err:.3g} vs float64"
    note(rows=logits.shape[0], vocab=logits.shape[1], strided=sweep_case["strided"])


def test_apply_token_bitmask_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                                   conformance_device: torch.device) -> None:
    logits, x = _logits(sweep_case)
    rows, vocab = logits.shape
    rng = _rng(sweep_case)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=rng,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0, -1] = -2**31 if vocab % 32 == 0 else (1 << (vocab % 32 - 1))  # last token only
    bits = torch.tensor([1 << i for i in range(31)] + [-2**31], dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) & bits) != 0).flatten(1)[:, :vocab]
    ref = logits.masked_fill(~allowed, float("-inf"))
    x = x.to(conformance_device)
    backend_ops(conformance_backend).apply_token_bitmask(x, bitmask.to(conformance_device))
    got = x.cpu()
    bad = ~((got == ref) | (got.isinf() & ref.isinf() & (got.sign() == ref.sign())))
    assert not bad.any(), (f"apply_token_bitmask {tuple(logits.shape)}, strided "
                           f"{sweep_case['strided']}: {int(bad.sum())} logits differ, first at "
                           f"{[int(i) for i in torch.nonzero(bad)[0]]}")
    note(rows=rows, vocab=vocab, strided=sweep_case["strided"])


def test_fused_moe_sweep(conformance_backend: Backend, sweep_case: dict[str, Any],
                         conformance_device: torch.device) -> None:
    """Experts past 8 (60: Qwen1.5-MoE; 128: Qwen3-MoE), top-1/2/8, renormalized or not; router
    logits spread apart so every dtype picks the same experts."""
    from pagedllm.reference import moe as moe_ops

    case, dev = sweep_case, conformance_device
    rng, dt = _rng(case), torch_dtype(case["dtype"])
    t, e, k, h, i = case["rows"], case["experts"], case["topk"], 96, 56
    x = torch.randn(t, h, generator=rng).to(dt)
    w13 = (torch.randn(e, 2 * i, h, generator=rng) / h ** 0.5).to(dt)
    w2 = (torch.randn(e, h, i, generator=rng) / i ** 0.5).to(dt)
    logits = torch.stack([torch.randperm(e, generator=rng) for _ in range(t)]).float() * 0.25
    logits = logits.to(dt)
    with torch.inference_mode():
        got = backend_ops(conformance_backend).fused_moe(x.to(dev), w13.to(dev), w2.to(dev),
                                                         logits.to(dev), k, case["renormalize"])
    ref = moe_ops.fused_moe(x.double(), w13.double(), w2.double(), logits.double(), k,
                            case["renormalize"])
    close(got, ref, case["dtype"], f"fused_moe {t} tokens, {e} experts, top-{k}, "
                                   f"renormalize {case['renormalize']}")
    note(rows=t, experts=e, topk=k, renormalize=case["renormalize"])
