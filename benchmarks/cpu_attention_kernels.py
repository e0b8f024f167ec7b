"""The cpu C++ attention kernels alone (prefill and decode), timed in CPU seconds of one thread,
so that a loaded machine skews them less than wall time; for A/B runs across kernel builds.

    python benchmarks/cpu_attention_kernels.py [--dtype bfloat16] [--sources DIR --isa avx2]

Without --sources it loads the package's kernels (pagedllm/backends/cpu/kernels.py). With
--sources DIR it builds DIR's paged_attention_cpu.cpp + prefill_attention_cpu.cpp (e.g. an
older commit's: ``git show REV:csrc/cpu/X > DIR/X`` for the .cpp and .h files) for --isa, so
the two builds run as two processes of this script, one after the other. Shapes: bench99m's
attention (16 query / 4 kv heads of 64, block 16): prefill of 32 prompts of 8-384 tokens
(workloads.py's lengths), decode of 64 sequences of 200-480 tokens. Prints the median of
--repeats calls and the achieved attention GFLOP/s (4 x head_size x query heads per visible
(query, key) pair).
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger("cpu_attention_kernels")


def load_ops(sources: Path | None, isa: str):
    if sources is None:
        from pagedllm.backends.cpu.kernels import load_cpu_kernels
        return load_cpu_kernels()
    from torch.utils.cpp_extension import load

    from pagedllm.backends.cpu.kernels import _AVX2, _AVX512
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"] + (_AVX2 if isa == "avx2" else _AVX512)
    load("pagedllm_cpu_ab", [str(sources / "paged_attention_cpu.cpp"),
                             str(sources / "prefill_attention_cpu.cpp")],
         extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
         build_directory=tempfile.mkdtemp(prefix="attn-ab-"), verbose=False)
    return torch.ops.pagedllm_cpu


def paged(lens: list[int], heads: int, kv_heads: int, d: int, block: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding every sequence in shuffled blocks, and the block tables."""
    blocks = [(n + block - 1) // block for n in lens]
    ids = list(range(sum(blocks)))
    random.Random(0).shuffle(ids)
    cache = torch.randn(2, sum(blocks), block, kv_heads, d).to(dtype)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.tensor(ids[at:at + b], dtype=torch.int32)
        at += b
    return cache, tables


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sources", type=Path)
    p.add_argument("--isa", default="avx2", choices=["avx2", "avx512"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=16, help="query heads (Gemma-2 preset: 12)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--soft-cap", type=float, default=0.0, help="logits soft cap (Gemma-2: 50)")
    p.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    args = p.parse_args()
    torch.set_num_threads(1)  # thread_time counts this thread only
    ops = load_ops(args.sources, args.isa)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, d, block = args.heads, args.kv_heads, 64, 16
    extra = (args.window, args.soft_cap)
    scale = d ** -0.5
    rng = random.Random(0)
    torch.manual_seed(0)

    lens = [min(384, max(8, round(96 * 2.718 ** rng.gauss(0, 0.9)))) for _ in range(32)]
    cache, tables = paged(lens, heads, kv_heads, d, block, dtype)
    query = torch.randn(sum(lens), heads, d).to(dtype)
    out = torch.empty_like(query)
    starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    s = timed(lambda: ops.paged_attention_prefill(out, query, cache, tables, starts, seq_lens,
                                                  scale, *extra), args.repeats)
    pairs = sum(n * (n + 1) / 2 for n in lens)
    print(f"prefill {len(lens)} prompts, {sum(lens)} tokens, {args.dtype}: {1e3 * s:.1f} ms "
          f"CPU, {4 * d * heads * pairs / s / 1e9:.1f} GFLOP/s")

    lens = [rng.randint(200, 480) for _ in range(64)]
    cache, tables = paged(lens, heads, kv_heads, d, block, dtype)
    query = torch.randn(len(lens), heads, d).to(dtype)
    out = torch.empty_like(query)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    s = timed(lambda: ops.paged_attention_decode(out, query, cache, tables, seq_lens, scale,
                                                         *extra),
              args.repeats * 4)
    print(f"decode {len(lens)} sequences of 200-480, {args.dtype}: {1e3 * s:.2f} ms CPU, "
          f"{4 * d * heads * sum(lens) / s / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
