"""The cpu backend's ``apply_token_bitmask``: xgrammar's C++ kernel (a dependency of guided
decoding already) for contiguous float32 logits; the ops registry's torch reference otherwise
(and where xgrammar is not installed)."""
from __future__ import annotations

import torch

from pagedllm.models.layers.ops import apply_token_bitmask as reference


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where ``bitmask`` [rows, ceil(vocab / 32)] int32 has a 0 bit."""
    if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
        reference(logits, bitmask)
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=logits.shape[1],
                                    backend="cpu")


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True
