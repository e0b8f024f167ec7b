"""Guided decoding's token mask on the logits, in place, as one Triton kernel: token t of row r
keeps its logit iff bit t % 32 of int32 word t // 32 of the row's bitmask is set, else -inf.

Grid (rows, cdiv(vocab, BLOCK)): each program reads BLOCK / 32 words and writes only the masked
logits (a mostly-allowed row costs a read of its words and few stores). Runs on CPU tensors under
TRITON_INTERPRET=1 (how the tests exercise it without a GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

BLOCK = 1024  # tokens per program


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, vocab, logits_stride, bitmask_stride,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + offs, minus_inf, mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits`` [rows, vocab] (float, rows may be strided) and ``bitmask`` [rows,
    ceil(vocab / 32)] int32 on the same device; -inf where a bit is 0 (the ops registry's
    ``apply_token_bitmask``)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask: logits must be contiguous along the vocabulary")
    bitmask = bitmask.contiguous()
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bitmask, vocab, logits.stride(0),
                                      bitmask.stride(0), BLOCK=BLOCK)
