"""Triton greedy sampling (argmax and its logprob in one read) vs torch.argmax, float64 log_softmax.

Runs on CPU through Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported)
when no GPU is present; on a CUDA machine it runs the compiled kernels. Skipped without triton.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import triton_device

DEVICE = triton_device()  # before a kernel module imports triton

from pagedllm.backends.cuda import triton_sampling  # noqa: E402
from pagedllm.backends.cuda.triton_sampling import BLOCK, greedy_logprobs, split_plan  # noqa: E402

ATOL = 1e-5


def _randn(rows: int, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(DEVICE)


def _check(logits: torch.Tensor) -> None:
    """tokens == torch.argmax exactly; logprobs within ATOL of float64 log_softmax at them."""
    tokens, logprobs = greedy_logprobs(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.shape == logprobs.shape == (logits.shape[0],)
    ref_tokens = logits.argmax(dim=-1)
    ref_lp = torch.log_softmax(logits.double(), dim=-1).gather(1, ref_tokens[:, None]).squeeze(1)
    assert torch.equal(tokens.cpu(), ref_tokens.cpu())
    assert torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs.cpu().double(), ref_lp.cpu(), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "rows,vocab",
    [(1, 1000), (3, 1000), (64, 1000), (257, 1000),  # one split per row: stage 1 writes results
     (1, 32000), (3, 32000), (64, 32000), (257, 32000),  # 16, 16, 9 (last shorter) and 3 splits
     (1, 128256), (3, 128256)],  # Llama-3 vocab: 63 splits, 1 tile each; 44 of 1.5 tiles
)
def test_matches_torch(rows: int, vocab: int) -> None:
    _check(_randn(rows, vocab, seed=rows * 7 + vocab))


def test_row_stride_wider_than_vocab() -> None:
    wide = _randn(5, 33000, seed=1)
    _check(wide[:, :32000])  # row stride 33000; the tail of each row must not be read
    wide[:, 32000:] = 1e4  # would win every row if the kernel read past vocab
    _check(wide[:, :32000])


def test_large_magnitude() -> None:
    _check(_randn(3, 32000, seed=2, scale=30.0))
    _check(_randn(1, 128256, seed=3, scale=30.0))


@pytest.fixture(params=["spread", "one_program"])
def programs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """spread: the default split plan (a few rows -> one tile per program, two stages).
    one_program: one program scans a whole row, tile after tile (as at large batches)."""
    if request.param == "one_program":
        monkeypatch.setattr(triton_sampling, "TARGET_PROGRAMS", 1)
    return request.param


def test_ties_take_the_first_index(programs: str) -> None:
    vocab = 32000
    logits = _randn(7, vocab, seed=4)
    top = logits.max() + 1.0
    # (earlier, later) positions of two equal maxima: same tile, same lane of later tiles, other
    # splits, first/last element, inside the masked tail tile
    pairs = [(3, 7), (5, 5 + BLOCK), (100, vocab - 1), (0, vocab // 2), (vocab - 2, vocab - 1),
             (BLOCK - 1, BLOCK), (17, 17 + 3 * BLOCK)]
    for row, (a, b) in enumerate(pairs):
        logits[row, a] = top
        logits[row, b] = top
    tokens, _ = greedy_logprobs(logits)
    assert tokens.tolist() == [a for a, _ in pairs]
    _check(logits)


def test_constant_rows() -> None:
    for rows, vocab in ((2, 1000), (1, 32000)):
        logits = torch.full((rows, vocab), -3.5, device=DEVICE)
        tokens, logprobs = greedy_logprobs(logits)
        assert tokens.tolist() == [0] * rows
        expected = torch.full((rows,), -torch.log(torch.tensor(float(vocab))).item())
        torch.testing.assert_close(logprobs.cpu(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("vocab", [1000, 32000])  # one tile per row; 16 tiles per row
def test_minus_inf_entries(vocab: int, programs: str) -> None:
    logits = _randn(5, vocab, seed=5)
    gen = torch.Generator().manual_seed(6)
    logits[0][torch.rand(vocab, generator=gen).to(DEVICE) < 0.5] = float("-inf")  # scattered
    logits[1, : min(3 * BLOCK + 5, vocab - 1)] = float("-inf")  # whole tiles, next one's start
    logits[2, :] = float("-inf")  # one finite entry, at the very end: logprob 0
    logits[2, vocab - 1] = -7.0
    logits[3, 1:] = float("-inf")  # one finite entry, first
    logits[4, ::2] = float("-inf")  # every other lane
    _check(logits)


def test_half_precision_inputs() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        logits = _randn(3, 5000, seed=7, scale=4.0).to(dtype)
        tokens, logprobs = greedy_logprobs(logits)
        ref_tokens = logits.float().argmax(dim=-1)
        ref_lp = torch.log_softmax(logits.double(), -1).gather(1, ref_tokens[:, None]).squeeze(1)
        assert torch.equal(tokens.cpu(), ref_tokens.cpu())
        torch.testing.assert_close(logprobs.cpu().double(), ref_lp.cpu(), rtol=0, atol=ATOL)


def test_split_plan() -> None:
    for rows in (1, 2, 3, 64, 256, 257, 528, 1000):
        for vocab in (1, BLOCK, BLOCK + 1, 32000, 128256, 152064):
            splits, split_len = split_plan(rows, vocab)
            assert split_len % BLOCK == 0
            assert (splits - 1) * split_len < vocab <= splits * split_len  # none empty, all covered
    assert split_plan(1, 128256)[0] == 63  # one row spreads over the GPU
    assert split_plan(1000, 128256)[0] == 1


def test_empty_and_bad_inputs() -> None:
    tokens, logprobs = greedy_logprobs(torch.empty(0, 100, device=DEVICE))
    assert tokens.shape == logprobs.shape == (0,)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        greedy_logprobs(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        greedy_logprobs(torch.zeros(2, 10, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="vocab=0"):
        greedy_logprobs(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        greedy_logprobs(torch.zeros(10, 2, device=DEVICE).t())
