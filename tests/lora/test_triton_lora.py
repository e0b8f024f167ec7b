"""The Triton LoRA shrink/expand kernels (cuda backend) against the torch reference, on CPU
through Triton's interpreter when no GPU is present."""
from __future__ import annotations

import pytest
import torch
from triton_env import triton_device

DEVICE = triton_device()  # before triton is imported

from pagedllm.backends.cuda import triton_lora  # noqa: E402
from pagedllm.contract.lora import LoRAMapping  # noqa: E402
from pagedllm.reference import lora as ref  # noqa: E402
from lora_op_cases import SLOT_PATTERNS, _case, _close  # noqa: E402


@pytest.mark.parametrize("pattern", ["mixed", "none", "contiguous runs"])
@pytest.mark.parametrize("rows", [(0, 24, 32, 40), (0, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_reference(pattern: str, rows: tuple[int, ...],
                                        dtype: torch.dtype) -> None:
    slots = SLOT_PATTERNS[pattern]
    x, a, b, scales, y, mapping = _case(len(slots), slots, dtype, slice_rows=rows, k=80)
    want_h = ref.lora_shrink(x, a, mapping)
    want = y.clone()
    ref.lora_expand(want, want_h, b, scales, mapping, rows)
    dev = LoRAMapping(mapping.token_slots.to(DEVICE))
    got_h = triton_lora.lora_shrink(x.to(DEVICE), a.to(DEVICE), dev)
    got = y.to(DEVICE)
    triton_lora.lora_expand(got, got_h, b.to(DEVICE), scales.to(DEVICE), dev, rows)
    _close(got_h.cpu(), want_h)
    _close(got.cpu(), want)
