"""The fused rotary + K/V cache write (csrc/layer_kernels.cu rotary_and_cache_kernel).

Against the two ops it replaces, on the same inputs: the torch reference rotary
(pagedllm/models/layers/ops.py) of the q and k heads, bit for bit, written back into qkv in place,
then reshape_and_cache of the rotated k and the untouched v. The caches start poisoned with NaN:
every slot of the mapping must hold its token's rows afterwards and every other row must still be
NaN (padding slots -1 and slots past the cache write nothing). Runs on the GPU (skipped without one)
and on the CPU through the SIMT emulator.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

from pagedllm.models.layers import ops as reference

BACKENDS = [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUM_BLOCKS, BLOCK_SIZE = 6, 16

# (tokens, num_heads, num_kv_heads, head_size, layout); head_size 80 has 80-byte halves in 16-bit
# dtypes and "offset1" a misaligned qkv: both take the one-element path
CASES = [(1, 8, 2, 128, "contiguous"), (37, 8, 2, 64, "contiguous"), (5, 4, 4, 128, "strided"),
         (9, 6, 1, 80, "contiguous"), (7, 4, 2, 64, "offset1")]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.cpu().view(as_int), b.cpu().view(as_int))


def _qkv(t: int, width: int, layout: str, dtype: torch.dtype, device: str,
         gen: torch.Generator) -> torch.Tensor:
    row = width + (24 if layout == "strided" else 0)
    buf = torch.randn(t * row + 1, generator=gen).to(dtype).to(device)
    if layout == "offset1":
        return buf[1:].view(t, row)
    rows = buf[: t * row].view(t, row)
    return rows[:, 8: 8 + width] if layout == "strided" else rows


def _slots(t: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct slots in random blocks; the last two tokens (when there are 3+) are padding (-1)
    and a slot past the cache."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:t].clone()
    if t >= 3:
        slots[-2], slots[-1] = -1, NUM_BLOCKS * BLOCK_SIZE
    return slots


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("t,heads,kv_heads,head_size,layout", CASES)
def test_matches_rotary_then_reshape_and_cache(request: pytest.FixtureRequest, fixture: str,
                                               dtype: torch.dtype, t: int, heads: int,
                                               kv_heads: int, head_size: int, layout: str) -> None:
    ops: ModuleType = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    gen = torch.Generator().manual_seed(t * 1000 + heads * 10 + head_size)
    qkv = _qkv(t, (heads + 2 * kv_heads) * head_size, layout, dtype, device, gen)
    before = qkv.clone()
    cos = torch.randn(t, head_size, generator=gen).to(dtype).to(device)
    sin = torch.randn(t, head_size, generator=gen).to(dtype).to(device)
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size), float("nan"),
                          dtype=dtype, device=device)
    slots = _slots(t, gen)

    ops.rotary_and_cache(qkv, cos, sin, kv_cache[0], kv_cache[1], slots.to(device), heads)

    heads_view = before.view(t, -1, head_size)
    rotated = reference.rotary(heads_view[:, : heads + kv_heads], cos, sin)
    got = qkv.view(t, -1, head_size)
    assert _same_bits(got[:, : heads + kv_heads], rotated), "q/k not rotated in place as rotary"
    assert _same_bits(got[:, heads + kv_heads:], heads_view[:, heads + kv_heads:]), "v changed"

    expected = torch.full_like(kv_cache, float("nan")).cpu()
    flat = expected.view(2, NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_size)
    for i, slot in enumerate(slots.tolist()):
        if 0 <= slot < NUM_BLOCKS * BLOCK_SIZE:
            flat[0, slot] = rotated[i, heads:].cpu()
            flat[1, slot] = heads_view[i, heads + kv_heads:].cpu()
    written = ~expected.isnan()
    assert torch.equal(kv_cache.cpu().isnan(), ~written), "a cache row outside the slots changed"
    assert _same_bits(kv_cache.cpu()[written], expected[written])


def test_bad_arguments_raise(cuda_ops: ModuleType) -> None:
    from pagedllm.backends.cuda.checks import KernelArgumentError

    dev = "cuda"
    qkv = torch.randn(3, (8 + 2 * 2) * 64, dtype=torch.bfloat16, device=dev)
    cos = torch.randn(3, 64, dtype=torch.bfloat16, device=dev)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, dtype=torch.bfloat16, device=dev)
    slots = torch.arange(3, device=dev)
    ok = dict(qkv=qkv, cos=cos, sin=cos, key_cache=cache[0], value_cache=cache[1],
              slot_mapping=slots, num_heads=8)
    cuda_ops.rotary_and_cache(**ok)
    for change, match in [(dict(num_heads=6), "columns"), (dict(sin=cos[:2]), "sin"),
                          (dict(slot_mapping=slots.int()), "slot_mapping"),
                          (dict(value_cache=cache[1].half()), "value")]:
        with pytest.raises(KernelArgumentError, match=match):
            cuda_ops.rotary_and_cache(**{**ok, **change})
    # the bindings check on their own too; their messages carry numbers and shapes
    kernels = cuda_ops.load_kernels()
    with pytest.raises(RuntimeError, match=r"640 columns .* got \[3, 768\]"):
        kernels.rotary_and_cache(qkv, cos, cos, cache[0], cache[1], slots, 6)
    kv = qkv.view(3, -1, 64)[:, 8:10]
    with pytest.raises(RuntimeError, match=r"key_cache must have shape \[6, 16, 2, 32\]"):
        kernels.reshape_and_cache(kv[..., :32], kv[..., 32:], cache[0], cache[1], slots)
