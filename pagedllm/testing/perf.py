"""Perf mode of the conformance kit: the backend's attention, cache write, block copy and swap
timed over the suite's shapes, in GB/s and tokens/s, so a vendor sees where a port stands
against the cpu and cuda backends.

    python -m pagedllm.testing.perf --device NAME [--dtype bfloat16] [--json out.json]

Bytes are what the operation must move at least: decode reads each sequence's K and V once;
a write stores K and V of every token; copy reads and writes whole blocks; swap moves them
across the host link. Timings are medians over ``--iters`` runs after a warm-up, with the
backend's ``synchronize`` around each.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.contract.backend import Backend
from pagedllm.testing.harness import garbage_cache, make_attention, torch_dtype
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

logger = logging.getLogger(__name__)

# (label, specs): the suite's shapes at a size where timing means something
SHAPES: dict[str, list[SeqSpec]] = {
    "decode 16 x 1024": [SeqSpec(1023, 1)] * 16,
    "decode 64 x 256": [SeqSpec(255, 1)] * 64,
    "prefill 4 x 256": [SeqSpec(0, 256)] * 4,
}
HEADS, KV_HEADS, HEAD_SIZE = 16, 4, 128


def _median_seconds(backend: Backend, fn: Callable[[], Any], iters: int) -> float:
    fn()
    backend.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_perf(backend: Backend, dtype: str, iters: int = 5) -> list[dict[str, Any]]:
    """One row per (operation, shape): seconds, GB/s and, for attention, tokens/s."""
    device = torch.device(backend.torch_device)
    bs = backend.capabilities.preferred_block_size
    elem = torch.tensor([], dtype=torch_dtype(dtype)).element_size()
    rng = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for label, specs in SHAPES.items():
        impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=HEADS,
                              num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
        batch = PagedBatch.random(specs, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                  head_size=HEAD_SIZE, block_size=bs, dtype=torch_dtype(dtype),
                                  device=device, generator=rng)
        cache = garbage_cache(impl, batch.num_blocks, bs, dtype, device, rng)
        batch.write_context(impl, cache, device)
        tokens = batch.query.shape[0]
        kv_read = sum(s.seq_len for s in specs) * 2 * KV_HEADS * HEAD_SIZE * elem
        secs = _median_seconds(backend, lambda: batch.run(impl, cache, device), iters)
        rows.append({"op": "attention", "shape": label, "seconds": secs,
                     "gb_per_s": kv_read / secs / 1e9, "tokens_per_s": tokens / secs})
        meta = batch.step_metadata(device)
        written = tokens * 2 * KV_HEADS * HEAD_SIZE * elem
        secs = _median_seconds(backend, lambda: impl.write_kv(batch.key, batch.value, cache,
                                                               meta), iters)
        rows.append({"op": "cache write", "shape": label, "seconds": secs,
                     "gb_per_s": written / secs / 1e9, "tokens_per_s": tokens / secs})
    rows += _block_moves(backend, dtype, bs, iters)
    return rows


def _block_moves(backend: Backend, dtype: str, bs: int, iters: int) -> list[dict[str, Any]]:
    device = torch.device(backend.torch_device)
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
    num_blocks, moved, layers = 512, 128, 4
    shape = tuple(impl.kv_cache_shape(num_blocks, bs, KV_HEADS, HEAD_SIZE))
    caches = [torch.zeros(shape, dtype=torch_dtype(dtype), device=device) for _ in range(layers)]
    block_bytes = caches[0][:, :1].numel() * caches[0].element_size()
    pairs = torch.stack([torch.arange(moved), torch.arange(moved) + moved], 1)
    ops = backend.cache_ops()
    rows = []
    secs = _median_seconds(backend, lambda: ops.copy_blocks(caches, pairs.to(device)), iters)
    rows.append({"op": "block copy", "shape": f"{layers} layers x {moved} blocks",
                 "seconds": secs, "gb_per_s": 2 * layers * moved * block_bytes / secs / 1e9})
    if backend.capabilities.swap:
        host = [torch.zeros(tuple(impl.kv_cache_shape(moved, bs, KV_HEADS, HEAD_SIZE)),
                            dtype=torch_dtype(dtype), pin_memory=backend.host_pin_memory())
                for _ in range(layers)]
        out_pairs = torch.stack([torch.arange(moved), torch.arange(moved)], 1)
        for direction, src, dst in (("swap out", caches, host), ("swap in", host, caches)):
            secs = _median_seconds(backend, lambda: ops.swap_blocks(src, dst, out_pairs), iters)
            rows.append({"op": direction, "shape": f"{layers} layers x {moved} blocks",
                         "seconds": secs, "gb_per_s": layers * moved * block_bytes / secs / 1e9})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'operation':<12} {'shape':<22} {'ms':>9} {'GB/s':>8} {'tokens/s':>11}"]
    for r in rows:
        tps = f"{r['tokens_per_s']:>11.0f}" if "tokens_per_s" in r else f"{'-':>11}"
        lines.append(f"{r['op']:<12} {r['shape']:<22} {r['seconds'] * 1e3:>9.3f} "
                     f"{r['gb_per_s']:>8.2f} {tps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.testing.perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="backend name (see `pagedllm backends`)")
    p.add_argument("--dtype", default=None, help="a declared dtype (default: the backend's)")
    p.add_argument("--iters", type=int, default=5, help="timed runs per operation (median)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    from pagedllm.contract.registry import resolve_backend

    backend = resolve_backend(args.device)
    dtype = args.dtype or backend.default_dtype
    if dtype not in backend.capabilities.dtypes:
        p.error(f"--dtype {dtype!r} is not declared by {backend.name}; declared: "
                f"{', '.join(backend.capabilities.dtypes)}")
    rows = run_perf(backend, dtype, args.iters)
    print(f"pagedllm conformance perf: {backend.name}, {dtype}, block size "
          f"{backend.capabilities.preferred_block_size}, heads {HEADS}/{KV_HEADS}x{HEAD_SIZE}")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend.name, "dtype": dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
