"""KV-cache kernels (csrc/cache_kernels.cu): reshape_and_cache, copy_blocks, swap_blocks.

Each runs on the GPU through the extension (skipped without one) and on the CPU through the SIMT
emulator; results are compared with plain torch indexing. Caches are poisoned with NaN before a
write so that both "every target written" and "nothing else touched" are checked.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]


def _backend(request: pytest.FixtureRequest, fixture: str) -> tuple[ModuleType, str]:
    return request.getfixturevalue(fixture), ("cuda" if fixture == "cuda_ops" else "cpu")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison compares equal to itself)."""
    as_int = {4: torch.int32, 2: torch.int16}
    return torch.equal(a.cpu().view(as_int[a.element_size()]), b.cpu().view(as_int[b.element_size()]))


# ---- reshape_and_cache ------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (80, 32), (64, 16), (6, 16)])
def test_reshape_and_cache(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype,
                           head_size: int, block_size: int) -> None:
    ops, device = _backend(request, fixture)
    gen = torch.Generator().manual_seed(head_size + block_size)
    num_tokens, num_kv_heads, num_blocks = 37, 3, 9
    # key/value as views into a fused qkv projection output (strided rows), like the engine's.
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = t[:, 4 * head_size : (4 + num_kv_heads) * head_size]
        v = t[:, (4 + num_kv_heads) * head_size :]
        return k.view(num_tokens, num_kv_heads, head_size), v.view(num_tokens, num_kv_heads, head_size)

    key, value = split(qkv)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)

    expected = kv_cache.clone()
    real = slots >= 0
    expected[0].view(-1, num_kv_heads, head_size)[slots[real]] = key[real]
    expected[1].view(-1, num_kv_heads, head_size)[slots[real]] = value[real]

    kv_cache = kv_cache.to(device)
    dev_key, dev_value = split(qkv.to(device))
    ops.reshape_and_cache(dev_key, dev_value, kv_cache[0], kv_cache[1], slots.to(device))
    assert _same(kv_cache, expected)


@pytest.mark.parametrize("fixture", BACKENDS)
def test_reshape_and_cache_skips_out_of_range_slots(request: pytest.FixtureRequest, fixture: str) -> None:
    ops, device = _backend(request, fixture)
    kv_cache = torch.zeros(2, 2, 16, 1, 64, device=device)
    key = torch.ones(3, 1, 64, device=device)
    slots = torch.tensor([0, 32, 10**9], dtype=torch.int64, device=device)  # 32 == num_slots
    ops.reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots)
    flat = kv_cache.cpu().view(2, 32, 64)
    assert flat[:, 0].eq(1).all() and flat[:, 1:].eq(0).all()


def test_reshape_and_cache_bad_arguments(cuda_ops: ModuleType) -> None:
    kv_cache = torch.zeros(2, 4, 16, 2, 64, device="cuda")
    key = torch.zeros(5, 2, 64, device="cuda")
    slots = torch.arange(5, device="cuda")
    cuda_ops.reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        cuda_ops.reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots.int())
    with pytest.raises(RuntimeError, match="slot_mapping"):
        cuda_ops.reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots[:4])
    with pytest.raises(RuntimeError, match="value|dtype|Half"):
        cuda_ops.reshape_and_cache(key, key.half(), kv_cache[0], kv_cache[1], slots)
    with pytest.raises(RuntimeError, match="key_cache"):
        cuda_ops.reshape_and_cache(key[:, :1].contiguous(), key[:, :1].contiguous(), kv_cache[0],
                                   kv_cache[1], slots)
    with pytest.raises(RuntimeError, match="CUDA|device"):
        cuda_ops.reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots.cpu())


# ---- copy_blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("mapping_on_cpu", [False, True], ids=["mapping-gpu", "mapping-cpu"])
def test_copy_blocks(request: pytest.FixtureRequest, fixture: str, dtype: torch.dtype,
                     mapping_on_cpu: bool) -> None:
    ops, device = _backend(request, fixture)
    if fixture == "emu_ops" and mapping_on_cpu:
        pytest.skip("the emulated launcher takes the mapping as is")
    gen = torch.Generator().manual_seed(11)
    num_layers, num_blocks = 3, 12
    caches = [torch.randn(2, num_blocks, 16, 2, 64, generator=gen).to(dtype) for _ in range(num_layers)]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 8], [11, 1]], dtype=torch.int64)
    expected = [c.clone() for c in caches]
    for c in expected:
        for src, dst in mapping.tolist():
            c[:, dst] = c[:, src]
    dev_caches = [c.to(device) for c in caches]
    ops.copy_blocks([c[0] for c in dev_caches], [c[1] for c in dev_caches],
                    mapping if mapping_on_cpu else mapping.to(device))
    for got, want in zip(dev_caches, expected):
        assert torch.equal(got.cpu(), want)


def test_copy_blocks_bad_arguments(cuda_ops: ModuleType) -> None:
    caches = [torch.zeros(2, 4, 16, 2, 64, device="cuda") for _ in range(2)]
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    with pytest.raises(RuntimeError, match="out of range"):
        cuda_ops.copy_blocks(keys, values, torch.tensor([[0, 4]]))  # CPU mapping is checked
    with pytest.raises(RuntimeError, match="block_mapping"):
        cuda_ops.copy_blocks(keys, values, torch.tensor([0, 1], device="cuda"))
    with pytest.raises(RuntimeError, match="value caches"):
        cuda_ops.copy_blocks(keys, values[:1], torch.tensor([[0, 1]], device="cuda"))
    with pytest.raises(RuntimeError, match="shape and strides"):
        cuda_ops.copy_blocks(keys, [values[0], torch.zeros(4, 16, 2, 32, device="cuda")],
                             torch.tensor([[0, 1]], device="cuda"))


# ---- swap_blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_swap_blocks_both_directions(cuda_ops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gpu = torch.randn(10, 16, 2, 64, generator=gen).to(dtype).cuda()
    cpu = torch.randn(6, 16, 2, 64, generator=gen).to(dtype).pin_memory()
    gpu_before, cpu_before = gpu.cpu(), cpu.clone()

    out_map = torch.tensor([[1, 0], [7, 4], [9, 5]], dtype=torch.int64)  # gpu -> cpu
    cuda_ops.swap_blocks(gpu, cpu, out_map)
    torch.cuda.synchronize()
    want_cpu = cpu_before.clone()
    for src, dst in out_map.tolist():
        want_cpu[dst] = gpu_before[src]
    assert torch.equal(cpu, want_cpu)

    in_map = torch.tensor([[0, 2], [5, 3]], dtype=torch.int64)  # cpu -> gpu
    cuda_ops.swap_blocks(cpu, gpu, in_map)
    torch.cuda.synchronize()
    want_gpu = gpu_before.clone()
    for src, dst in in_map.tolist():
        want_gpu[dst] = want_cpu[src]
    assert torch.equal(gpu.cpu(), want_gpu)


def test_swap_blocks_layer_of_engine_cache(cuda_ops: ModuleType) -> None:
    """Swapping kv_cache[0] / kv_cache[1] views of the engine layout [2, num_blocks, ...]."""
    gpu = torch.randn(2, 8, 16, 2, 64).cuda()
    cpu = torch.zeros(2, 4, 16, 2, 64).pin_memory()
    mapping = torch.tensor([[6, 1], [2, 3]], dtype=torch.int64)
    for i in range(2):
        cuda_ops.swap_blocks(gpu[i], cpu[i], mapping)
    torch.cuda.synchronize()
    assert torch.equal(cpu[:, 1], gpu[:, 6].cpu()) and torch.equal(cpu[:, 3], gpu[:, 2].cpu())
    assert cpu[:, 0].eq(0).all() and cpu[:, 2].eq(0).all()


def test_swap_blocks_bad_arguments(cuda_ops: ModuleType) -> None:
    gpu = torch.zeros(4, 16, 2, 64, device="cuda")
    cpu = torch.zeros(3, 16, 2, 64).pin_memory()
    with pytest.raises(RuntimeError, match="out of range"):
        cuda_ops.swap_blocks(gpu, cpu, torch.tensor([[0, 3]]))
    with pytest.raises(RuntimeError, match="out of range"):
        cuda_ops.swap_blocks(gpu, cpu, torch.tensor([[-1, 0]]))
    with pytest.raises(RuntimeError, match="on the CPU"):
        cuda_ops.swap_blocks(gpu, cpu, torch.tensor([[0, 1]], device="cuda"))
    with pytest.raises(RuntimeError, match="block shape"):
        cuda_ops.swap_blocks(gpu, torch.zeros(3, 16, 2, 32).pin_memory(), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="Half|Float|dtype"):
        cuda_ops.swap_blocks(gpu, cpu.half(), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_ops.swap_blocks(cpu, cpu.clone(), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_swap_blocks_emulated(emu_ops: ModuleType, dtype: torch.dtype) -> None:
    src = torch.randn(5, 16, 2, 64).to(dtype)
    dst = torch.zeros(4, 16, 2, 64, dtype=dtype)
    emu_ops.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 3]], dtype=torch.int64))
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[3], src[1])
    assert dst[1:3].eq(0).all()
