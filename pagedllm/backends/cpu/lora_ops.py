"""LoRA's shrink and expand on the cpu: one GEMM per adapter slot in use, over that slot's tokens.

The references (reference/lora.py) find each slot's tokens with a mask per slot and op; here the
step's grouping is computed once on the host (``LoRAMapping.groups``: a slice where a slot's
tokens are contiguous, as a prefill chunk's are, else an index) and shared by every linear of
the step, and a step whose tokens all run one adapter is a single GEMM. Slots in a wider dtype
than the activations (the cpu runs half-precision models' LoRA in float32: LoRAConfig.lora_dtype)
take the activations converted once per op.

Both ops run on one thread. Their GEMMs are small (rank 16: a few percent of the layer's FLOPs)
and many (one per adapter and stacked slice); on two cores shared with other processes each
multi-threaded one waits at OpenMP's barrier for a thread the OS has not scheduled: a
[16, 1024] x [1024, 48] product took 29 ms on two threads and 0.3 ms on one (load ~11, AVX2 Zen
1), and a step with 8 adapters spent most of its time there. Switching the thread count costs
~0.6 us.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from pagedllm.contract.lora import LoRAMapping

F = TypeVar("F", bound=Callable[..., Any])


def one_thread(fn: F) -> F:
    """Run ``fn`` with torch's intra-op threads set to 1, restored after."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        if threads == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper  # type: ignore[return-value]


@one_thread
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """x [T, in], lora_a [S, N, in] -> [T, N] (lora_a's dtype); zeros without an adapter."""
    t, n = x.shape[0], lora_a.shape[1]
    groups = mapping.groups()
    xc = x.to(lora_a.dtype)
    if len(groups) == 1 and groups[0][1] == slice(0, t):
        return torch.mm(xc, lora_a[groups[0][0]].t())
    out = xc.new_zeros(t, n)
    for slot, rows in groups:
        if isinstance(rows, slice):
            torch.mm(xc[rows], lora_a[slot].t(), out=out[rows])
        else:
            out.index_put_((rows,), torch.mm(xc[rows], lora_a[slot].t()))
    return out


@one_thread
def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                mapping: LoRAMapping, slice_rows: Sequence[int]) -> None:
    """In place: y [T, out] += each slice's (h block @ B^T) * scale, per token's slot."""
    rank = lora_b.shape[2]
    num_slices = len(slice_rows) - 1
    host_scales = scales.tolist()  # [S][n]: one read for every group
    for slot, rows in mapping.groups():
        hs = h[rows]
        if num_slices == 1:
            delta = torch.mm(hs, lora_b[slot].t())
            delta.mul_(host_scales[slot][0])
        else:
            delta = hs.new_empty(hs.shape[0], slice_rows[-1])
            for i in range(num_slices):
                lo, hi = slice_rows[i], slice_rows[i + 1]
                part = torch.mm(hs[:, i * rank:(i + 1) * rank], lora_b[slot, lo:hi].t())
                torch.mul(part, host_scales[slot][i], out=delta[:, lo:hi])
        delta = delta.to(y.dtype)
        if isinstance(rows, slice):
            y[rows].add_(delta)
        else:  # index_put_ (not index_add_: an OpenMP region per call, ~10x slower here)
            y.index_put_((rows,), delta, accumulate=True)
