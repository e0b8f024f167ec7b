"""GPU check of the paged decode kernel: correctness spot check, then speed against copy bandwidth.

    python benchmarks/gpu_kernel_check.py            # on the GPU machine, from the repository root

(a) device-to-device copy bandwidth (bytes read + written, median over repeats, CUDA events);
(b) the decode kernel for batch 64, context 1024, 32 query / 8 kv heads, head 128, bf16, block 16:
    time, achieved bandwidth (K/V read once + q + out) and its fraction of (a) (target >= 70%);
(c) a table over batch 1/8/64/256 x context 128/1024/4096.
Decode calls are timed inside a CUDA graph of many calls (falls back to eager timing if capture
fails), so small shapes report GPU time rather than Python launch overhead.

Inputs rotate over several disjoint regions of one large cache (each region its own block tables and
queries) so that the 50 MB L2 does not serve repeated reads. Only torch and
pagedllm.backends.cuda.ops are used.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.backends.cuda import ops  # noqa: E402

ROTATE_BYTES = 512 * 2**20  # rotate over at least this much K/V
TARGET_FRACTION = 0.70


def time_ms(fn, repeats: int, inner: int) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls (ms, CUDA events)."""
    fn(0)
    torch.cuda.synchronize()
    samples = []
    for r in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(inner):
            fn(r * inner + i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def time_graph_ms(fn, repeats: int, inner: int) -> float | None:
    """Like time_ms, but `inner` calls are captured in one CUDA graph so that Python launch overhead
    does not count (it dominates small shapes). None when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(inner):
                fn(i)
    except RuntimeError as exc:
        print(f"    (CUDA graph capture failed, timing eagerly: {exc})")
        return None
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def copy_bandwidth(repeats: int) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    numel = 2 * 2**30 // 4  # 2 GiB of float32 per buffer
    src = torch.empty(numel, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda _: dst.copy_(src), repeats, inner=5)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


@dataclass
class DecodeSetup:
    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def kv_bytes(self) -> int:  # K and V read once
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_size * elem

    @property
    def qo_bytes(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.batch * self.num_heads * self.head_size * elem


def build(s: DecodeSetup, gen: torch.Generator) -> dict:
    """One cache pool and `sets` disjoint (block_tables, query) input sets over it."""
    sets = max(3, min(512, -(-ROTATE_BYTES // s.kv_bytes)))
    blocks_per_seq = -(-s.context // s.block_size)
    blocks_per_set = s.batch * blocks_per_seq
    num_blocks = sets * blocks_per_set
    kv_cache = torch.empty(2, num_blocks, s.block_size, s.num_kv_heads, s.head_size, dtype=s.dtype,
                           device="cuda").normal_(generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(sets, s.batch, blocks_per_seq)  # scattered blocks, disjoint per set
    queries = torch.randn(sets, s.batch, s.num_heads, s.head_size, dtype=s.dtype, device="cuda",
                          generator=gen)
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32, device="cuda")
    return dict(kv_cache=kv_cache, tables=tables, queries=queries, seq_lens=seq_lens, sets=sets)


def reference(s: DecodeSetup, x: dict, i: int) -> torch.Tensor:
    """float32 torch attention of input set i."""
    kv = x["kv_cache"][:, x["tables"][i].long()]  # [2, batch, blocks, bs, kvh, d]
    kv = kv.flatten(2, 3)[:, :, : s.context].float()  # [2, batch, ctx, kvh, d]
    k = kv[0].repeat_interleave(s.num_heads // s.num_kv_heads, dim=2)
    v = kv[1].repeat_interleave(s.num_heads // s.num_kv_heads, dim=2)
    q = x["queries"][i].float()  # [batch, heads, d]
    scores = torch.einsum("bhd,bthd->bht", q, k) * s.head_size**-0.5
    return torch.einsum("bht,bthd->bhd", scores.softmax(-1), v)


def run_decode(s: DecodeSetup, repeats: int, check: bool,
               partition: int | None = None) -> tuple[float, float]:
    """(ms per call, max abs error vs reference or nan); partition None: the kernel's own choice."""
    kernels = ops.load_kernels()
    x = build(s, torch.Generator(device="cuda").manual_seed(0))
    out = torch.empty(s.batch, s.num_heads, s.head_size, dtype=s.dtype, device="cuda")
    if partition is None:
        partition = kernels.decode_partition_size(s.batch, s.num_heads, s.num_kv_heads, s.context)
    parts = -(-s.context // partition)
    f32 = dict(dtype=torch.float32, device="cuda")
    tmp = (torch.empty(s.batch, s.num_heads, parts, s.head_size, **f32),
           torch.empty(s.batch, s.num_heads, parts, **f32),
           torch.empty(s.batch, s.num_heads, parts, **f32)) if parts > 1 else (None, None, None)
    key_cache, value_cache = x["kv_cache"][0], x["kv_cache"][1]

    def call(i: int) -> None:
        j = i % x["sets"]
        kernels.paged_attention(out, x["queries"][j], key_cache, value_cache, s.num_kv_heads,
                                s.head_size**-0.5, x["tables"][j], x["seq_lens"], s.block_size,
                                s.context, *tmp, partition)

    error = float("nan")
    if check:
        out.fill_(float("nan"))
        call(1)
        error = (out.float() - reference(s, x, 1)).abs().max().item()
    inner = max(10, min(200, x["sets"]))
    ms = time_graph_ms(call, repeats, inner)
    if ms is None:
        ms = time_ms(call, repeats, inner)
    del x
    torch.cuda.empty_cache()
    return ms, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-table", action="store_true", help="skip (c)")
    parser.add_argument("--shapes", help="instead of (c): BATCH:CONTEXT,... timed at the kernel's "
                        "own partition only (a quick sweep, e.g. 1:128,256:128,64:1024)")
    args = parser.parse_args()

    ok, reason = ops.kernels_available(build=True)
    if not ok:
        print(f"kernels unavailable: {reason}")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")

    copy_bw = copy_bandwidth(args.repeats)
    print(f"(a) device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)")

    s = DecodeSetup(batch=64, context=1024)
    ms, err = run_decode(s, args.repeats, check=True)
    bw = (s.kv_bytes + s.qo_bytes) / (ms * 1e-3)
    verdict = "PASS" if bw / copy_bw >= TARGET_FRACTION and err < 2e-2 else "BELOW TARGET"
    print(f"(b) decode bf16 batch 64 ctx 1024 heads 32/8 d128 block 16: {ms * 1e3:.1f} us, "
          f"{bw / 1e12:.2f} TB/s = {100 * bw / copy_bw:.1f}% of copy bandwidth "
          f"(target {100 * TARGET_FRACTION:.0f}%), max abs err vs fp32 torch {err:.2e}: {verdict}")

    if args.shapes:
        print("(c) batch  context      us  %copy   max_err")
        for shape in args.shapes.split(","):
            batch, context = (int(v) for v in shape.split(":"))
            s = DecodeSetup(batch=batch, context=context)
            ms, err = run_decode(s, args.repeats, check=batch * context <= 64 * 4096)
            bw = (s.kv_bytes + s.qo_bytes) / (ms * 1e-3)
            print(f"    {batch:5d} {context:8d} {ms * 1e3:7.1f} {100 * bw / copy_bw:6.1f} {err:9.2e}")
    elif not args.no_table:
        kernels = ops.load_kernels()
        sizes = [64, 128, 256, 512, 1024]
        print("(c) batch  context  chosen      us    TB/s  %copy   max_err | us with partition "
              + " ".join(f"{p:>6d}" for p in sizes))
        for batch in (1, 8, 64, 256):
            for context in (128, 1024, 4096):
                s = DecodeSetup(batch=batch, context=context)
                chosen = kernels.decode_partition_size(batch, s.num_heads, s.num_kv_heads, context)
                ms, err = run_decode(s, args.repeats, check=batch * context <= 64 * 4096)
                bw = (s.kv_bytes + s.qo_bytes) / (ms * 1e-3)
                err_text = f"{err:9.2e}" if err == err else f"{'unchecked':>9}"  # nan: not checked
                sweep = [run_decode(s, max(3, args.repeats // 3), False, p)[0] * 1e3 for p in sizes]
                print(f"    {batch:5d} {context:8d} {chosen:7d} {ms * 1e3:7.1f} {bw / 1e12:7.2f} "
                      f"{100 * bw / copy_bw:6.1f} {err_text} | {'':17s}"
                      + " ".join(f"{t:6.1f}" for t in sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
