"""The cpu backend's C++ decode attention (csrc/cpu/paged_attention_cpu.cpp, attention "native"):
the kernel against a float64 reference, its argument checks, and how the backend picks it.

Every case draws fresh random inputs and scatters each sequence's blocks over a shuffled pool;
every cache slot no sequence owns (unused blocks, the tail of a last block, padding entries of the
block tables) holds NaN, as does the output before the call, so a read outside a sequence's
tokens or a row left unwritten shows up as NaN. Tests that need the kernels skip where they
cannot be built (the cpu_kernels fixture in tests/conftest.py)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.testing.harness import raw_config

HEADS = [(4, 4), (8, 2), (8, 1)]  # (num_heads, num_kv_heads): MHA, GQA, MQA
NAN = float("nan")


@dataclass
class Case:
    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float


def make_case(seq_lens: list[int], *, num_heads: int, num_kv_heads: int, head_size: int,
              block_size: int, dtype: torch.dtype, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(need) + 2  # every row ends in padding entries
    num_blocks = sum(need) + 6
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    unused = pool[sum(need):]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), NAN)
    tables = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, need)):
        blocks, pool = pool[:nb], pool[nb:]
        tables[i] = torch.tensor(blocks + [unused[(i + j) % len(unused)]
                                           for j in range(max_blocks - nb)])
        for t in range(n):  # slots past the last token keep their NaN
            cache[:, blocks[t // block_size], t % block_size] = torch.randn(
                2, num_kv_heads, head_size, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    return Case(query.to(dtype), cache.to(dtype), tables,
                torch.tensor(seq_lens, dtype=torch.int32), head_size ** -0.5)


def reference(case: Case) -> torch.Tensor:
    """float64 softmax(scale * q K^T) V per sequence; query head h reads kv head h // group."""
    block_size, num_kv_heads, head_size = case.cache.shape[2:]
    group = case.query.shape[1] // num_kv_heads
    out = []
    for i, n in enumerate(case.seq_lens.tolist()):
        blocks = case.tables[i, :math.ceil(n / block_size)].long()
        k, v = (case.cache[j, blocks].reshape(-1, num_kv_heads, head_size)[:n].double()
                .repeat_interleave(group, dim=1) for j in (0, 1))  # [n, num_heads, head_size]
        p = (torch.einsum("hd,nhd->hn", case.query[i].double(), k) * case.scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def run_kernel(ops, case: Case, query: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    query = case.query if query is None else query
    out = torch.full_like(case.query, NAN) if out is None else out
    ops.paged_attention_decode(out, query, case.cache, case.tables, case.seq_lens, case.scale)
    return out


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert got.dtype == dtype and not got.isnan().any(), "NaN in the output"
    err = (got.double() - ref).abs()
    assert bool((err <= tol + tol * ref.abs()).all()), f"max |error| {err.max().item():.3g}"


def seq_lens_for(block_size: int) -> list[int]:
    # first token, a whole block, two whole blocks, just past one, ragged, shorter than a tile
    return [1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1, 5]


# --- the kernel against the reference --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_decode_matches_reference(cpu_kernels, heads: tuple[int, int], head_size: int,
                                  block_size: int, dtype: torch.dtype) -> None:
    case = make_case(seq_lens_for(block_size), num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, block_size=block_size, dtype=dtype,
                     seed=head_size + block_size)
    assert_close(run_kernel(cpu_kernels, case), reference(case), dtype)


@pytest.mark.parametrize("head_size", [36, 256])  # scalar tails; a multiple of the 64-wide chunk
def test_decode_float16_and_other_head_sizes(cpu_kernels, head_size: int) -> None:
    case = make_case([1, 9, 40, 77], num_heads=6, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=torch.float16)
    assert_close(run_kernel(cpu_kernels, case), reference(case), torch.float16)


def _prefill_metadata(query_lens: list[int], context_lens: list[int], block_size: int):
    """The model runner's metadata for one prefill step: sequence i has context_lens[i] cached
    tokens and query_lens[i] new ones, in blocks of its own."""
    from pagedllm.core.batch import ScheduledSeq
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.model_runner import build_metadata

    seqs, next_block = [], 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        blocks = math.ceil((q + c) / block_size)
        seqs.append(ScheduledSeq(seq_id=i, token_ids=[1] * q, start_pos=c,
                                 block_table=list(range(next_block, next_block + blocks)),
                                 sampling_params=SamplingParams(), num_samples=1,
                                 prompt_len=q + c))
        next_block += blocks
    return build_metadata(seqs, block_size, torch.device("cpu"))[2], next_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("query_lens,context_lens", [([32] * 5, [0] * 5), ([7, 7], [0, 0]),
                                                     ([5, 9, 3], [0, 0, 0]), ([6, 6], [0, 10])])
def test_prefill_matches_the_reference(cpu_kernels, query_lens: list[int],
                                       context_lens: list[int], dtype: torch.dtype) -> None:
    """The native prefill (csrc/cpu/prefill_attention_cpu.cpp, over the cache) on strided views
    of a qkv projection, as in the model, against the torch reference: equal within float
    rounding (its online softmax sums in another order), for prompts of one length, of several,
    and with cached context."""
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    heads, kv_heads, d, bs = 8, 2, 64, 16
    meta, num_blocks = _prefill_metadata(query_lens, context_lens, bs)
    gen = torch.Generator().manual_seed(sum(query_lens) + sum(context_lens))
    t = sum(query_lens)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=gen).to(dtype)  # the context
    ref = TorchPagedAttention(heads, d, kv_heads, d ** -0.5)
    ref.write_kv(k, v, cache, meta)
    want = ref.prefill(q, cache, meta, k, v)
    got = CpuNativePagedAttention(heads, d, kv_heads, d ** -0.5).prefill(q, cache, meta, k, v)
    assert got.shape == want.shape == (t, heads, d)
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_strided_query_and_out(cpu_kernels) -> None:
    """query as the engine passes it (a view into a wider qkv row) and out as a view too."""
    case = make_case([3, 17, 33], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32)
    num_seqs, num_heads, head_size = case.query.shape
    qkv = torch.randn(num_seqs, 3 * num_heads * head_size)
    query = qkv[:, :num_heads * head_size].view(num_seqs, num_heads, head_size)
    query.copy_(case.query)
    out = torch.full((num_heads, num_seqs, head_size), NAN).transpose(0, 1)
    assert not query.is_contiguous() and not out.is_contiguous()
    run_kernel(cpu_kernels, case, query=query, out=out)
    assert_close(out, reference(case), torch.float32)


def test_thread_count_changes_nothing(cpu_kernels) -> None:
    """The work split depends on the thread count (few sequences split their kv heads); the
    result must not."""
    threads = torch.get_num_threads()
    for seq_lens in ([70], [5, 90, 31]):
        case = make_case(seq_lens, num_heads=8, num_kv_heads=4, head_size=64, block_size=16,
                         dtype=torch.float32)
        try:
            torch.set_num_threads(1)
            one = run_kernel(cpu_kernels, case)
        finally:
            torch.set_num_threads(threads)
        for n in {2, threads}:
            torch.set_num_threads(n)
            try:
                assert torch.equal(run_kernel(cpu_kernels, case), one)
            finally:
                torch.set_num_threads(threads)


# --- argument checks -------------------------------------------------------------------------
def _set(**fields: object):
    """A mutation of a Case: fields -> functions of the case giving their new values."""
    def mutate(case: Case) -> None:
        for name, value in fields.items():
            setattr(case, name, value(case))
    return mutate


def _set_entry(field: str, index: tuple[int, int] | int, value) -> object:
    def mutate(case: Case) -> None:
        getattr(case, field)[index] = value(case)
    return mutate


BAD_INPUTS = {  # name: (mutation, the error message it must raise)
    "block id past the cache": (_set_entry("tables", (1, 0), lambda c: c.cache.shape[1]),
                                "outside the cache's blocks"),
    "negative block id": (_set_entry("tables", (0, 0), lambda c: -1),
                          "outside the cache's blocks"),
    "empty sequence": (_set_entry("seq_lens", 0, lambda c: 0), r"seq_lens\[0\]=0 must be in \[1, "),
    "longer than its table": (_set_entry("seq_lens", 0,
                                         lambda c: c.tables.shape[1] * c.cache.shape[2] + 1),
                              "must be in"),
    "int64 block table": (_set(tables=lambda c: c.tables.long()), "block_tables must be int32"),
    "int64 seq_lens": (_set(seq_lens=lambda c: c.seq_lens.long()), "seq_lens must be int32"),
    "cache dtype": (_set(cache=lambda c: c.cache.double()), "must have one dtype"),
    "float64": (_set(cache=lambda c: c.cache.double(), query=lambda c: c.query.double()),
                "float32, bfloat16 or float16"),
    "heads not a multiple": (_set(query=lambda c: c.query[:, :3]), "must be a multiple"),
    "head size": (_set(query=lambda c: c.query[..., :32]), "head_size"),
    "cache rank": (_set(cache=lambda c: c.cache[0]), "kv_cache must be"),
    "strided last dim": (_set(query=lambda c: c.query.transpose(1, 2)), "contiguous"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises(cpu_kernels, name: str) -> None:
    case = make_case([20, 40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32)
    mutate, message = BAD_INPUTS[name]
    mutate(case)
    out = torch.empty(case.query.shape, dtype=case.query.dtype)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_attention_decode(out, case.query, case.cache, case.tables,
                                           case.seq_lens, case.scale)


def test_out_shape_is_checked(cpu_kernels) -> None:
    case = make_case([20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32)
    with pytest.raises(RuntimeError, match="out must have the shape of query"):
        run_kernel(cpu_kernels, case, out=torch.empty(2, 4, 64))


# --- the backend's choice --------------------------------------------------------------------
@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)  # set by --attention-backend
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    return raw_config(CpuBackend(), dtype="float32", block_size=16)


def test_native_is_the_default(cpu_kernels, config) -> None:
    from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

    assert CpuBackend().attention_cls(config) is CpuNativePagedAttention
    config.attention_backend = "native"
    assert CpuBackend().attention_cls(config) is CpuNativePagedAttention
    config.attention_backend = "torch"
    assert CpuBackend().attention_cls(config) is TorchPagedAttention
    config.attention_backend = "flash"
    with pytest.raises(ValueError, match="allowed: native, torch, ipex"):
        CpuBackend().attention_cls(config)


def test_env_turns_the_kernels_off(config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert CpuBackend().attention_cls(config) is TorchPagedAttention
    config.attention_backend = "native"
    with pytest.raises(RuntimeError, match="disabled by PAGEDLLM_CPU_KERNELS=0"):
        CpuBackend().attention_cls(config)


FAILED_BUILD = """
import logging
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
from pagedllm.backends.cpu.backend import CpuBackend
backend = CpuBackend()
for _ in range(3):
    print(backend.attention_cls(SimpleNamespace(attention_backend=None)).__name__)
try:
    backend.attention_cls(SimpleNamespace(attention_backend="native"))
except RuntimeError as exc:
    print("native:", str(exc).splitlines()[0])
"""


def test_failed_build_falls_back_with_one_warning(tmp_path) -> None:
    """No working compiler (CXX=false) and an empty kernel cache: the default falls back to the
    torch attention with one warning; asking for "native" by name raises with the reason."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDLLM_ATTENTION_BACKEND", "PAGEDLLM_CPU_KERNELS")}
    env.update(CXX="false", PAGEDLLM_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", FAILED_BUILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[:3] == ["TorchPagedAttention"] * 3
    assert "native: cannot build the pagedllm cpu kernels" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1 and "runs the torch reference attention and layer ops: cannot build" in proc.stderr
