"""Decode attention alone on the cpu backend: the torch reference (gather + SDPA) against the C++
kernel ("native"), timed in turns in one process so that the machine's drift hits both alike.

    python benchmarks/cpu_decode_attention.py                  # bench99m's shape, batch 64
    python benchmarks/cpu_decode_attention.py --batch 1 --context 1024 --threads 1

Each sequence's blocks come from a shuffled pool. "cold" writes a buffer larger than the
last-level cache before every call, as the rest of a model's layers do between two attention
calls; "warm" repeats calls on the same data.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch

from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, nargs=2, default=[64, 96], metavar=("MIN", "MAX"),
                   help="sequence lengths are drawn from [MIN, MAX]")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.context[0], args.context[1] + 1, (args.batch,), generator=gen,
                         dtype=torch.int32)
    max_blocks = -(-args.context[1] // args.block_size)
    num_blocks = args.batch * max_blocks
    cache = torch.randn(2, num_blocks, args.block_size, args.kv_heads, args.head_size,
                        generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(args.batch, max_blocks).int()
    query = torch.randn(args.batch, args.heads, args.head_size, generator=gen).to(dtype)
    metadata = SimpleNamespace(decode_block_tables=tables, decode_seq_lens=lens)
    shape = (args.heads, args.head_size, args.kv_heads, args.head_size ** -0.5)
    impls = {"torch": TorchPagedAttention(*shape), "native": CpuNativePagedAttention(*shape)}
    err = (impls["torch"].decode(query, cache, metadata).double()
           - impls["native"].decode(query, cache, metadata).double()).abs().max().item()

    flush = torch.empty(64 * 2 ** 20 // 4)  # 64 MiB, more than the last-level cache
    kv_mib = 2 * int(lens.sum()) * args.kv_heads * args.head_size * cache.element_size() / 2**20
    print(f"batch {args.batch}, context {args.context[0]}-{args.context[1]}, heads "
          f"{args.heads}/{args.kv_heads}, head_size {args.head_size}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, KV read per call {kv_mib:.1f} MiB; "
          f"max |torch - native| {err:.2g}")
    for mode in ("cold", "warm"):
        times: dict[str, list[float]] = {name: [] for name in impls}
        for i in range(args.calls + 3):
            for name, impl in impls.items():
                if mode == "cold":
                    flush.fill_(i)
                seconds = _time(lambda: impl.decode(query, cache, metadata))
                if i >= 3:
                    times[name].append(seconds)
        medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        cells = [f"{name} median {us:.0f} us (min {min(times[name]) * 1e6:.0f})"
                 for name, us in medians.items()]
        print(f"{mode}: {', '.join(cells)}; torch / native "
              f"{medians['torch'] / medians['native']:.2f}x")


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
