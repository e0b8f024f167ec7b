"""Model ops as the backend registers them (``register_ops``) against the float64 reference.

Ops a backend leaves alone run the torch reference on its device, which still checks that the
device supports them.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.contract.backend import Backend
from pagedllm.reference import ops as reference
from pagedllm.reference.ops import Ops
from pagedllm.testing.harness import tolerance, torch_dtype

AREA = "model ops"


def _ops(backend: Backend) -> Ops:
    ops = Ops()
    backend.register_ops(ops)
    return ops


def _rand(rng: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=rng)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    assert got.dtype == torch_dtype(dtype), f"{what}: returned {got.dtype}, expected {dtype}"
    got = got.cpu().double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    tol = tolerance(dtype)
    # outputs of magnitude ~1-10 after a reduction: allow one rounding step of the dtype
    assert torch.allclose(got, ref, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4), (
        f"{what}: max |error| {(got - ref).abs().max().item():.3g} vs float64 reference")


def test_rms_norm(conformance_backend: Backend, conformance_dtype: str,
                  conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    rng = conformance_rng
    x, res, w = _rand(rng, 7, 256), _rand(rng, 7, 256), _rand(rng, 256)
    dt, dev = torch_dtype(conformance_dtype), conformance_device
    ops = _ops(conformance_backend)
    normed, residual = ops.rms_norm(x.to(dt).to(dev), w.to(dt).to(dev), 1e-6, res.to(dt).to(dev))
    ref_normed, ref_residual = reference.rms_norm(x.to(dt).double(), w.to(dt).double(), 1e-6,
                                                  res.to(dt).double())
    _close(normed, ref_normed, conformance_dtype, "rms_norm (normed)")
    _close(residual, ref_residual, conformance_dtype, "rms_norm (new residual)")


def test_gemma_rms_norm(conformance_backend: Backend, conformance_dtype: str,
                        conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    """Gemma's (1 + w) norm; w small, as trained Gemma norms are (zeros = identity)."""
    rng = conformance_rng
    x, res, w = _rand(rng, 7, 256), _rand(rng, 7, 256), _rand(rng, 256) * 0.5
    dt, dev = torch_dtype(conformance_dtype), conformance_device
    normed, residual = _ops(conformance_backend).gemma_rms_norm(
        x.to(dt).to(dev), w.to(dt).to(dev), 1e-6, res.to(dt).to(dev))
    ref_normed, ref_residual = reference.gemma_rms_norm(x.to(dt).double(), w.to(dt).double(),
                                                        1e-6, res.to(dt).double())
    _close(normed, ref_normed, conformance_dtype, "gemma_rms_norm (normed)")
    _close(residual, ref_residual, conformance_dtype, "gemma_rms_norm (new residual)")


def test_rotary(conformance_backend: Backend, conformance_dtype: str,
                conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    t, d = 9, 64
    pos = torch.arange(t, dtype=torch.float64)[:, None]
    freqs = pos * (10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))[None, :]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)  # [T, D]
    qk = _rand(conformance_rng, t, 10, d)  # 8 query heads and 2 key heads, rotated together
    dt, dev = torch_dtype(conformance_dtype), conformance_device
    got = _ops(conformance_backend).rotary(qk.to(dt).to(dev), cos.to(dt).to(dev), sin.to(dt).to(dev))
    ref = reference.rotary(qk.to(dt).double(), cos.to(dt).double(), sin.to(dt).double())
    _close(got, ref, conformance_dtype, "rotary")


def test_silu_and_mul(conformance_backend: Backend, conformance_dtype: str,
                      conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    x = _rand(conformance_rng, 5, 2 * 96).to(torch_dtype(conformance_dtype))
    got = _ops(conformance_backend).silu_and_mul(x.to(conformance_device))
    _close(got, reference.silu_and_mul(x.double()), conformance_dtype, "silu_and_mul")


def test_gelu_tanh_and_mul(conformance_backend: Backend, conformance_dtype: str,
                           conformance_device: torch.device,
                           conformance_rng: torch.Generator) -> None:
    x = _rand(conformance_rng, 5, 2 * 96).to(torch_dtype(conformance_dtype))
    got = _ops(conformance_backend).gelu_tanh_and_mul(x.to(conformance_device))
    _close(got, reference.gelu_tanh_and_mul(x.double()), conformance_dtype, "gelu_tanh_and_mul")


def test_linear(conformance_backend: Backend, conformance_dtype: str,
                conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    dt = torch_dtype(conformance_dtype)
    layer = nn.Module()
    weight = (_rand(conformance_rng, 96, 128) / 128 ** 0.5).to(dt)
    bias = _rand(conformance_rng, 96).to(dt)
    layer.weight = nn.Parameter(weight.to(conformance_device), requires_grad=False)
    layer.bias = nn.Parameter(bias.to(conformance_device), requires_grad=False)
    x = _rand(conformance_rng, 11, 128).to(dt)
    ops = _ops(conformance_backend)
    ops.linear_prepare(layer)
    with torch.inference_mode():
        got = ops.linear(x.to(conformance_device), layer)
    ref = x.double() @ weight.double().T + bias.double()
    _close(got, ref, conformance_dtype, "linear (after linear_prepare)")


def test_greedy_logprobs(conformance_backend: Backend, conformance_device: torch.device,
                         conformance_rng: torch.Generator) -> None:
    """The sampler's all-greedy op: the first index of each row's max (ties included) and its
    logprob, on float32 logits as the engine passes them (including a row-strided view)."""
    logits = _rand(conformance_rng, 5, 3000) * 4
    logits[1, 700] = logits[1, 2900] = logits[1].max() + 1.0  # an exact tie: 700 must win
    logits[2, :100] = float("-inf")  # masked entries
    wide = torch.zeros(5, 3100)
    wide[:, :3000] = logits
    ref_lp = logits.double().log_softmax(-1)
    ops = _ops(conformance_backend)
    for what, x in (("contiguous", logits), ("row-strided view", wide[:, :3000])):
        tokens, lp = ops.greedy_logprobs(x.to(conformance_device))
        tokens = tokens.cpu()
        assert tokens.dtype == torch.int64, f"greedy_logprobs ({what}): tokens are {tokens.dtype}"
        assert tokens.tolist() == logits.argmax(-1).tolist(), f"greedy_logprobs ({what}): tokens"
        chosen = ref_lp.gather(1, tokens[:, None]).squeeze(1)
        err = (lp.cpu().double() - chosen).abs().max().item()
        assert err < 1e-4, f"greedy_logprobs ({what}): logprob error {err:.3g} vs float64"


def test_apply_token_bitmask(conformance_backend: Backend, conformance_device: torch.device,
                             conformance_rng: torch.Generator) -> None:
    """Guided decoding's mask: token t of row r keeps its logit iff bit t % 32 of word t // 32 is
    set (int32 words, bit 31 included), else -inf; in place, on a vocabulary that is not a
    multiple of 32 and a row-strided view."""
    rows, vocab = 4, 1000
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=conformance_rng,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0
    bitmask[2, 3] = -2**31  # only token 3 * 32 + 31
    logits = _rand(conformance_rng, rows, vocab)
    allowed = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
               for r in range(rows)]
    ref = torch.where(torch.tensor(allowed), logits, torch.full_like(logits, float("-inf")))
    ops = _ops(conformance_backend)
    wide = torch.zeros(rows, vocab + 24)
    wide[:, :vocab] = logits
    for what, x in (("contiguous", logits.clone()), ("row-strided view", wide[:, :vocab])):
        x = x.to(conformance_device)
        ops.apply_token_bitmask(x, bitmask.to(conformance_device))
        assert torch.equal(x.cpu(), ref), f"apply_token_bitmask ({what}): masked logits differ"


def test_fused_moe(conformance_backend: Backend, conformance_dtype: str,
                   conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    """Top-2 of 8 experts (renormalized) and top-3 (not), vs the per-expert reference in float64;
    the router logits are spread apart so every dtype picks the same experts."""
    from pagedllm.reference import moe as moe_ops

    rng, dt, dev = conformance_rng, torch_dtype(conformance_dtype), conformance_device
    t, e, h, i = 13, 8, 64, 48
    x = _rand(rng, t, h).to(dt)
    w13 = (_rand(rng, e, 2 * i, h) / h ** 0.5).to(dt)
    w2 = (_rand(rng, e, h, i) / i ** 0.5).to(dt)
    logits = torch.stack([torch.randperm(e, generator=rng) for _ in range(t)]).to(dt)
    ops = _ops(conformance_backend)
    for topk, renormalize in ((2, True), (3, False)):
        with torch.inference_mode():
            got = ops.fused_moe(x.to(dev), w13.to(dev), w2.to(dev), logits.to(dev), topk,
                                renormalize)
        ref = moe_ops.fused_moe(x.double(), w13.double(), w2.double(), logits.double(), topk,
                                renormalize)
        _close(got, ref, conformance_dtype, f"fused_moe (top-{topk}, renormalize={renormalize})")
