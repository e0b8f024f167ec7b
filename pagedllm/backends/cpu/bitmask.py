"""The cpu backend's ``apply_token_bitmask``: the csrc/cpu kernel (bitmask_cpu.cpp: one pass
over the packed words, all-ones words skipped) where the cpu kernels load; else xgrammar's C++
kernel (a dependency of guided decoding already) for contiguous float32 logits; the ops
registry's torch reference otherwise (and where neither is there)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.reference.ops import apply_token_bitmask as reference


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where ``bitmask`` [rows, ceil(vocab / 32)] int32 has a 0 bit."""
    if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
        reference(logits, bitmask)
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=logits.shape[1],
                                    backend="cpu")


def native_apply_token_bitmask(kernels: Any) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The op on ``kernels`` (torch.ops.pagedllm_cpu) for float32 [rows, vocab] logits with a
    contiguous last dim on the cpu and an int32 mask of as many rows; the fallbacks above
    otherwise."""
    fallback = apply_token_bitmask if available() else reference

    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if (logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
                and logits.device.type == "cpu" and bitmask.device.type == "cpu"
                and bitmask.dtype == torch.int32 and bitmask.dim() == 2
                and bitmask.shape[0] == logits.shape[0]
                and bitmask.shape[1] * 32 >= logits.shape[1]):
            kernels.apply_token_bitmask(logits, bitmask.contiguous())
            return
        fallback(logits, bitmask)

    return apply


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True
