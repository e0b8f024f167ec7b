"""The cpu backend's apply_token_bitmask kernel (csrc/cpu/bitmask_cpu.cpp) against the ops
registry's torch reference: bit-identical masked logits on every shape the model runner hands it,
and a clear error for a mask of the wrong shape."""
from __future__ import annotations

import pytest
import torch

from pagedllm.backends.cpu import bitmask
from pagedllm.models.layers.ops import apply_token_bitmask as reference


@pytest.fixture(scope="module")
def kernels():
    from pagedllm.backends.cpu.kernels import load_cpu_kernels

    try:
        return load_cpu_kernels()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def _mask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64)
    m = m.to(torch.int32)
    if rows > 1:
        m[0] = -1  # all allowed: the words the kernel skips
    if rows > 2:
        m[1] = 0
        m[1, -1] = -2**31  # bit 31 of the last word only (a token past vocab where padded)
    return m


@pytest.mark.parametrize("rows,vocab,extra_words", [(1, 32, 0), (3, 1000, 0), (64, 8192, 0),
                                                     (5, 33, 0), (4, 1000, 2), (0, 64, 0)])
def test_native_equals_reference(kernels, rows: int, vocab: int, extra_words: int) -> None:
    words = (vocab + 31) // 32 + extra_words
    m = _mask(rows, words, seed=vocab + rows)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    if rows:
        logits[0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    want = logits.clone()
    reference(want, m)
    apply = bitmask.native_apply_token_bitmask(kernels)
    got = logits.clone()
    apply(got, m)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), "masked logits differ"
    # a row-strided view of wider logits (the sampler's logits[:n] of a padded batch)
    wide = torch.zeros(rows, vocab + 24)
    wide[:, :vocab] = logits
    view = wide[:, :vocab]
    apply(view, m)
    assert torch.equal(view.nan_to_num(), want.nan_to_num())
    assert torch.equal(wide[:, vocab:], torch.zeros(rows, 24)), "wrote past the row"


def test_kernel_rejects_a_short_mask(kernels) -> None:
    logits = torch.zeros(2, 100)
    with pytest.raises(RuntimeError, match="bitmask must be"):
        kernels.apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="bitmask must be"):
        kernels.apply_token_bitmask(logits, torch.zeros(2, 4, dtype=torch.int64))


def test_wrapper_falls_back_for_other_dtypes(kernels) -> None:
    m = _mask(3, 32, seed=1)
    logits = torch.randn(3, 1000).to(torch.bfloat16)
    want = logits.clone()
    reference(want, m)
    got = logits.clone()
    bitmask.native_apply_token_bitmask(kernels)(got, m)
    assert torch.equal(got, want)
