"""Paged decode attention (csrc/paged_attention.cu) vs a float64 reference.

test_*_cuda run the built extension on a GPU (skipped without one) over the full matrix of head
sizes, block sizes, dtypes and MHA/GQA/MQA; test_*_emulated run the same kernel source on the CPU
through the SIMT emulator over a representative subset. Contexts longer than one partition
exercise the partitioned (v2) path and its reduce kernel: the partition size is chosen per launch
(64..1024 tokens, shorter for few sequences), so these small batches mostly run short partitions,
and test_partition_sizes forces each size.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from kernel_reference import attention_f64, paged_decode_ref

HEAD_SIZES = (64, 80, 96, 112, 128, 256)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (num_heads, num_kv_heads): MHA, GQA 4, MQA 8, groups of 6 and 3 (idle head slots), MQA 16 (2 chunks)
HEAD_CONFIGS = ((4, 4), (8, 2), (8, 1), (12, 2), (6, 2), (16, 1))
SHORT = (1, 7, 16, 17, 33, 512)          # max 512: single pass
LONG = (1, 15, 100, 513, 1024, 1300)     # up to 3 partitions
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_size: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    seq_lens: tuple[int, ...]

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"{dt}-d{self.head_size}-bs{self.block_size}-h{self.num_heads}/{self.num_kv_heads}"
                f"-max{max(self.seq_lens)}")


def make_inputs(case: Case, device: str, seed: int) -> dict:
    """Random inputs in the engine's layout; every cache slot a sequence does not own is NaN."""
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_size
    blocks_per_seq = [max(1, -(-n // bs)) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv_cache = torch.full((2, num_blocks, bs, kvh, d), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(case.seq_lens), max(blocks_per_seq) + 1), 10**6, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(case.seq_lens, blocks_per_seq)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[i, :nb] = ids.to(torch.int32)
        pos = torch.arange(n)
        kv_cache[:, ids[pos // bs], pos % bs] = torch.randn(2, n, kvh, d, generator=gen)
    kv_cache = kv_cache.to(case.dtype)
    query = torch.randn(len(case.seq_lens), case.num_heads, d, generator=gen).to(case.dtype)
    return dict(
        query=query.to(device),
        kv_cache=kv_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
    )


def run_and_check(ops: ModuleType, case: Case, device: str, seed: int = 0,
                  partition_size: int | None = None, num_warps: int = 0) -> None:
    x = make_inputs(case, device, seed)
    key_cache, value_cache = x["kv_cache"][0], x["kv_cache"][1]
    scale = case.head_size**-0.5
    out = torch.full_like(x["query"], float("nan"))
    ops.paged_attention(out, x["query"], key_cache, value_cache, case.num_kv_heads, scale,
                        x["block_tables"], x["seq_lens"], case.block_size, max(case.seq_lens),
                        partition_size=partition_size, num_warps=num_warps)
    ref = paged_decode_ref(x["query"].cpu(), key_cache.cpu(), value_cache.cpu(),
                           x["block_tables"].cpu(), x["seq_lens"].cpu(), scale)
    out = out.cpu()
    assert not torch.isnan(out).any(), f"{case}: output not fully written (or NaN read from unused slots)"
    torch.testing.assert_close(out.double(), ref, rtol=TOL[case.dtype], atol=TOL[case.dtype],
                               msg=lambda m: f"{case}: {m}")


CUDA_CASES = [
    Case(dt, d, bs, 8, 2, lens)
    for dt in DTYPES for d in HEAD_SIZES for bs in BLOCK_SIZES for lens in (SHORT, LONG)
] + [
    Case(dt, 128, 16, h, kvh, lens)
    for dt in DTYPES for (h, kvh) in HEAD_CONFIGS for lens in (SHORT, LONG)
]

EMU_CASES = [
    Case(torch.float32, 128, 16, 8, 2, (1, 17, 600)),
    Case(torch.bfloat16, 128, 16, 32, 8, (1, 33, 200)),
    Case(torch.float16, 64, 32, 4, 4, (5, 1030)),
    Case(torch.bfloat16, 80, 16, 12, 2, (7, 300)),
    Case(torch.float32, 96, 32, 8, 1, (513,)),
    Case(torch.float16, 112, 16, 16, 1, (40,)),
    Case(torch.float32, 256, 16, 6, 2, (3, 520)),
    Case(torch.bfloat16, 256, 32, 2, 1, (64,)),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_paged_attention_cuda(cuda_ops: ModuleType, case: Case) -> None:
    run_and_check(cuda_ops, case, "cuda")


@pytest.mark.parametrize("case", EMU_CASES, ids=str)
def test_paged_attention_emulated(emu_ops: ModuleType, case: Case) -> None:
    run_and_check(emu_ops, case, "cpu")


# ---- edge cases (both backends) -------------------------------------------------------------


def _edge_backends() -> list:
    return [pytest.param("cuda_ops", id="cuda"), pytest.param("emu_ops", id="emulated")]


@pytest.mark.parametrize("fixture", _edge_backends())
@pytest.mark.parametrize("partition_size", [64, 128, 256, 512, 1024])
def test_partition_sizes(request: pytest.FixtureRequest, fixture: str, partition_size: int) -> None:
    """Every partition size over contexts shorter than, equal to and several times one partition."""
    ops = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    for case in (Case(torch.bfloat16, 128, 16, 8, 2, (1, 64, 65, 300, 1100)),
                 Case(torch.float32, 64, 32, 4, 4, (129, 1024, 2050))):
        run_and_check(ops, case, device, seed=partition_size, partition_size=partition_size)


def test_partition_size_rule(emu_ops: ModuleType) -> None:
    """Long partitions while the grid has enough blocks; shorter ones for few sequences; never
    longer than the context needs (csrc/ops.h paged_attention_partition_size)."""
    rule = emu_ops.decode_partition_size  # (num_seqs, num_heads, num_kv_heads, max_seq_len)
    assert rule(64, 32, 8, 1024) == 1024   # 512 blocks already: one pass, no reduce
    assert rule(256, 32, 8, 512) == 512    # the context needs no more
    assert rule(8, 32, 8, 4096) == 512     # 64 blocks per partition: 8 partitions each
    assert rule(1, 32, 8, 4096) == 64      # one sequence: as many blocks as possible
    assert rule(1, 32, 8, 200) == 64
    assert rule(256, 32, 8, 8192) == 1024
    assert rule(4, 8, 8, 1) == 64          # the minimum


@pytest.mark.parametrize("fixture", _edge_backends())
@pytest.mark.parametrize("num_warps", [2, 4])
def test_block_widths(request: pytest.FixtureRequest, fixture: str, num_warps: int) -> None:
    """Both compiled thread-block widths, forced, over one and several partitions and GQA 1/4/8."""
    ops = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    for case, partition in ((Case(torch.bfloat16, 128, 16, 8, 2, (1, 64, 65, 300)), 128),
                            (Case(torch.float16, 64, 32, 16, 2, (200, 17)), 256),
                            (Case(torch.float32, 80, 16, 3, 3, (129, 1030)), 1024)):
        run_and_check(ops, case, device, seed=num_warps, partition_size=partition,
                      num_warps=num_warps)


def test_block_width_rule(emu_ops: ModuleType) -> None:
    """2-warp blocks only for short partitions in large grids (csrc/ops.h
    paged_attention_narrow_blocks); the throughput workload (256 sequences x 8 kv heads, contexts
    up to 256) gets them, batch-1 decode and long contexts do not."""
    rule = emu_ops.decode_narrow_blocks  # (grid blocks, partition size)
    assert rule(256 * 8, 256) and rule(128 * 8, 128)
    assert not rule(64 * 8, 128)       # 512 blocks: 4 warps overlap enough
    assert not rule(256 * 8, 512)      # long partitions
    assert not rule(1 * 8 * 4, 64)     # batch 1


def test_bad_partition_size_raises(cuda_ops: ModuleType) -> None:
    case = Case(torch.float16, 128, 16, 8, 2, (5, 30))
    x = make_inputs(case, "cuda", seed=0)
    out = torch.empty_like(x["query"])
    for bad in (32, 96, 2048):
        with pytest.raises(ValueError, match="partition_size"):
            cuda_ops.paged_attention(out, x["query"], x["kv_cache"][0], x["kv_cache"][1], 2, 0.1,
                                     x["block_tables"], x["seq_lens"], 16, 30, partition_size=bad)
    with pytest.raises(ValueError, match="num_warps"):
        cuda_ops.paged_attention(out, x["query"], x["kv_cache"][0], x["kv_cache"][1], 2, 0.1,
                                 x["block_tables"], x["seq_lens"], 16, 30, num_warps=8)


@pytest.mark.parametrize("fixture", _edge_backends())
def test_strided_query_and_empty_sequence(request: pytest.FixtureRequest, fixture: str) -> None:
    """query as a view into a fused qkv tensor; a zero-length sequence (graph padding) gives zeros."""
    ops = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    case = Case(torch.float16, 128, 16, 8, 2, (0, 30, 700))
    x = make_inputs(case, device, seed=3)
    h, kvh, d = case.num_heads, case.num_kv_heads, case.head_size
    qkv = torch.randn(3, (h + 2 * kvh) * d, dtype=case.dtype, device=device)
    query = qkv[:, : h * d].view(3, h, d)
    assert not query.is_contiguous()
    out = torch.full((3, h, d), float("nan"), dtype=case.dtype, device=device)
    kc, vc = x["kv_cache"][0], x["kv_cache"][1]
    ops.paged_attention(out, query, kc, vc, kvh, d**-0.5, x["block_tables"], x["seq_lens"], 16, 700)
    out = out.cpu()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_decode_ref(query[1:].cpu(), kc.cpu(), vc.cpu(), x["block_tables"][1:].cpu(),
                           x["seq_lens"][1:].cpu(), d**-0.5)
    torch.testing.assert_close(out[1:].double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fixture", _edge_backends())
def test_out_of_range_block_id_masks_its_tokens(request: pytest.FixtureRequest, fixture: str) -> None:
    """A block-table entry outside [0, num_blocks) is never dereferenced; its tokens are skipped."""
    ops = request.getfixturevalue(fixture)
    device = "cuda" if fixture == "cuda_ops" else "cpu"
    case = Case(torch.float32, 64, 16, 4, 2, (600,))
    x = make_inputs(case, device, seed=5)
    kc, vc = x["kv_cache"][0], x["kv_cache"][1]
    table = x["block_tables"].clone()
    table[0, 2] = kc.shape[0] + 7  # tokens 32..47 are masked
    out = torch.full_like(x["query"], float("nan"))
    ops.paged_attention(out, x["query"], kc, vc, 2, 0.125, table, x["seq_lens"], 16, 600)
    keep = [t for t in range(600) if not 32 <= t < 48]
    pos = torch.tensor(keep)
    ids = x["block_tables"][0].cpu().long()[pos // 16]
    k, v = kc.cpu()[ids, pos % 16], vc.cpu()[ids, pos % 16]
    ref = attention_f64(x["query"].cpu(), k, v, 0.125)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)


# ---- argument checking (binding; GPU only) ----------------------------------------------------


def test_bad_arguments_raise(cuda_ops: ModuleType) -> None:
    case = Case(torch.float16, 128, 16, 8, 2, (10, 20))
    x = make_inputs(case, "cuda", seed=1)
    kc, vc = x["kv_cache"][0], x["kv_cache"][1]
    q, bt, sl = x["query"], x["block_tables"], x["seq_lens"]
    out = torch.empty_like(q)

    def call(**kw: object) -> None:
        args = dict(out=out, query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, scale=0.1,
                    block_tables=bt, seq_lens=sl, block_size=16, max_seq_len=20)
        args.update(kw)
        cuda_ops.paged_attention(**args)

    call()  # the unmodified call is fine
    with pytest.raises(RuntimeError, match="query|dtype|Half|BFloat16"):
        call(query=q.to(torch.bfloat16))  # dtype differs from the cache
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        call(query=q.double(), out=out.double(), key_cache=kc.double(), value_cache=vc.double())
    with pytest.raises(RuntimeError, match="block_tables"):
        call(block_tables=bt.long())
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(seq_lens=sl[:1])
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        call(query=q[:, :7].contiguous(), out=out[:, :7].contiguous())
    with pytest.raises(RuntimeError, match="key_cache"):
        call(num_kv_heads=4)  # disagrees with the cache shape
    with pytest.raises(RuntimeError, match="key_cache|block_size"):
        call(block_size=32)  # disagrees with the cache shape (key_cache check)
    small = torch.randn(4, 16, 2, 48, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="head_size"):
        call(query=q[..., :48].contiguous(), out=out[..., :48].contiguous(), key_cache=small,
             value_cache=small)
    odd = torch.randn(4, 24, 2, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="block_size"):
        call(key_cache=odd, value_cache=odd, block_size=24)
    with pytest.raises(RuntimeError, match="contiguous"):
        call(query=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="CUDA|device"):
        call(seq_lens=sl.cpu())
