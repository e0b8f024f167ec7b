"""Block copy and swap through the csrc/ kernels (one launch for all layers); caches of other
element types (an fp8 KV cache) take the reference byte copies of CacheOps. Block export /
import (KV offload and transfer) are torch copies on a side stream."""
from __future__ import annotations

import torch

from pagedllm.backends.cuda import ops
from pagedllm.contract import layer_fences
from pagedllm.contract.cache_ops import CacheOps, CacheTransfer
from pagedllm.reference import kv_transfer


KERNEL_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelCacheOps(CacheOps):
    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        if kv_caches and kv_caches[0].dtype not in KERNEL_CACHE_DTYPES:
            return CacheOps.copy_blocks(self, kv_caches, pairs)
        ops.copy_blocks([c[0] for c in kv_caches], [c[1] for c in kv_caches], pairs)

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        if src_caches and src_caches[0].dtype not in KERNEL_CACHE_DTYPES:
            return CacheOps.swap_blocks(self, src_caches, dst_caches, pairs)
        pairs = pairs.cpu()
        for src, dst in zip(src_caches, dst_caches):
            ops.swap_blocks(src[0], dst[0], pairs)
            ops.swap_blocks(src[1], dst[1], pairs)

    # --- block export / import (Capabilities.kv_export): torch copies on a side stream -------
    def export_blocks(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                      staging: torch.Tensor) -> CacheTransfer:
        """Gather the blocks into one device buffer [n, layers, bytes] and copy it to the
        (pinned) staging buffer, on a side stream that first waits for the work queued so far;
        the current stream waits for the gather only (a device copy), so the step that
        overwrites an exported block runs after it while the copy to the host overlaps the
        step. The host is not blocked."""
        if not kv_caches or kv_caches[0].device.type != "cuda":
            kv_transfer.export_blocks(kv_caches, block_ids, staging)
            return _DONE
        n = int(block_ids.numel())
        kv_transfer.check_staging(staging, kv_caches, n)
        if n == 0:
            return _DONE
        device = kv_caches[0].device
        side = _side_stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        planes = _layer_planes(staging)
        with torch.cuda.stream(side):
            ids = block_ids.to(device, non_blocking=True)
            # layer-major staging: gather layer-major too, and copy each layer's plane
            gathered = (torch.empty((staging.shape[1], n, staging.shape[2]), dtype=torch.uint8,
                                    device=device).transpose(0, 1) if planes
                        else torch.empty(staging.shape, dtype=torch.uint8, device=device))
            for layer, cache in enumerate(kv_caches):
                src = kv_transfer.byte_view(cache)
                kv_transfer.staging_rows(gathered, layer, src).copy_(src.index_select(1, ids))
            current.wait_stream(side)
            if planes:
                for layer in range(staging.shape[1]):
                    staging[:, layer].copy_(gathered[:, layer], non_blocking=True)
            else:
                staging.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return _StreamTransfer(event, (gathered, ids, staging))

    def import_blocks(self, staging: torch.Tensor, kv_caches: list[torch.Tensor],
                      block_ids: torch.Tensor) -> CacheTransfer:
        """Copy the staging buffer to the device and scatter its rows into the blocks on the
        load stream (after the work queued so far); ``fence()`` makes the current stream wait.
        Not the exports' stream: a load's host-to-device copy runs beside the device-to-host
        copy of the blocks evicted for it (each direction has its own copy engine), which the
        current stream does not wait for (only for their gather, queued before this)."""
        if not kv_caches or kv_caches[0].device.type != "cuda":
            kv_transfer.import_blocks(staging, kv_caches, block_ids)
            return _DONE
        n = int(block_ids.numel())
        kv_transfer.check_staging(staging, kv_caches, n)
        if n == 0:
            return _DONE
        device = kv_caches[0].device
        side = _side_stream(device, _LOAD_STREAMS)
        side.wait_stream(torch.cuda.current_stream(device))
        planes = _layer_planes(staging)
        layers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        with torch.cuda.stream(side):
            ids = block_ids.to(device, non_blocking=True)
            if planes:  # layer-major staging: each layer copied, scattered and marked in turn
                rows = torch.empty((staging.shape[1], n, staging.shape[2]), dtype=torch.uint8,
                                   device=device).transpose(0, 1)
            else:
                rows = staging.to(device, non_blocking=True)
            for layer, cache in enumerate(kv_caches):
                dst = kv_transfer.byte_view(cache)
                if planes:
                    rows[:, layer].copy_(staging[:, layer], non_blocking=True)
                dst.index_copy_(1, ids, kv_transfer.staging_rows(rows, layer, dst))
                if planes:
                    layers.append((cache, torch.cuda.Event()))
                    layers[-1][1].record(side)
            event = torch.cuda.Event()
            event.record(side)
        return _StreamTransfer(event, (rows, ids, staging), layers)


_DONE = CacheTransfer()
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # exports
_LOAD_STREAMS: dict[int, torch.cuda.Stream] = {}  # imports


def _side_stream(device: torch.device,
                 streams: dict[int, torch.cuda.Stream] = _SIDE_STREAMS) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


def _layer_planes(staging: torch.Tensor) -> bool:
    """Whether ``staging`` is a layer-major view (Capabilities.kv_export_layer_major): its rows
    not contiguous, each layer's plane ``staging[:, l]`` one contiguous piece."""
    return (staging.shape[1] > 1 and not staging.is_contiguous()
            and all(staging[:, layer].is_contiguous() for layer in range(staging.shape[1])))


class _StreamTransfer(CacheTransfer):
    """A transfer queued on the side stream; ``keep`` holds its buffers until it is done;
    ``layers`` (an import from layer-major staging): (layer cache, the event after its blocks
    are written)."""

    def __init__(self, event: torch.cuda.Event, keep: tuple,
                 layers: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None) -> None:
        self.event = event
        self._keep: tuple | None = keep
        self.layers = layers or []

    def done(self) -> bool:
        finished = bool(self.event.query())
        if finished:
            self._keep = None
        return finished

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = None

    def fence(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def fence_layers(self) -> None:
        """Each layer's attention waits for its own layer's event (layer_fences.py)."""
        if not self.layers:
            return self.fence()
        for cache, event in self.layers:
            layer_fences.add(cache, lambda e=event: torch.cuda.current_stream().wait_event(e))
