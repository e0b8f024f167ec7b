"""LoRA's shrink/expand: the reference against a per-token loop written from PEFT's formula, and
the cpu and Triton (interpreted on CPU without a GPU) kernels against the reference: mixed slots,
tokens without an adapter, stacked slices of different sizes, ranks below the slot's."""
from __future__ import annotations


import pytest
import torch

from pagedllm.backends.cpu import lora_ops as cpu
from pagedllm.contract.lora import NO_LORA, LoRAMapping
from pagedllm.reference import lora as ref

from lora_op_cases import SLOT_PATTERNS, _case, _close, _per_token


@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
def test_reference_is_pefts_formula(pattern: str) -> None:
    slots = SLOT_PATTERNS[pattern]
    x, a, b, scales, y, mapping = _case(len(slots), slots, torch.float64)
    rows = (0, 24, 32, 40)
    want = _per_token(x, a, b, scales, y, slots, rows)
    h = ref.lora_shrink(x, a, mapping)
    ref.lora_expand(y, h, b, scales, mapping, rows)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    none = [t for t, s in enumerate(slots) if s == NO_LORA]
    assert torch.equal(h[none], torch.zeros_like(h[none]))


@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("rows", [(0, 24, 32, 40), (0, 40), (0, 16, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_match_reference(pattern: str, rows: tuple[int, ...],
                                     dtype: torch.dtype) -> None:
    slots = SLOT_PATTERNS[pattern]
    x, a, b, scales, y, mapping = _case(len(slots), slots, dtype, slice_rows=rows)
    want_h = ref.lora_shrink(x, a, mapping)
    want = y.clone()
    ref.lora_expand(want, want_h, b, scales, mapping, rows)
    got_h = cpu.lora_shrink(x, a, LoRAMapping(mapping.token_slots, mapping.host_slots))
    got = y.clone()
    cpu.lora_expand(got, got_h, b, scales, mapping, rows)
    _close(got_h, want_h)
    _close(got, want)


def test_cpu_float32_slots_for_half_activations() -> None:
    """The cpu runs a bf16 model's LoRA in float32 slots (LoRAConfig.lora_dtype)."""
    slots = SLOT_PATTERNS["mixed"]
    x, a, b, scales, y, mapping = _case(8, slots, torch.float32)
    want = y.clone()
    ref.lora_expand(want, ref.lora_shrink(x, a, mapping), b, scales, mapping, (0, 24, 32, 40))
    yb = y.to(torch.bfloat16)
    cpu.lora_expand(yb, cpu.lora_shrink(x.to(torch.bfloat16), a, mapping), b, scales, mapping,
                    (0, 24, 32, 40))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), want, rtol=2e-2, atol=6e-2)
