"""Block copy on XLA caches with static shapes; no swap (the tpu backend declares swap=False)."""
from __future__ import annotations

import torch

from pagedllm.backends.tpu.buckets import next_power_of_two
from pagedllm.contract.cache_ops import CacheOps


class XlaCacheOps(CacheOps):
    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy-on-write. The pair count is padded on the host to a power of two (pad pairs
        copy block 0 to an out-of-range block, which XLA's scatter drops), so one program per
        power of two serves every step; it runs on its own, before the model step."""
        n = pairs.shape[0]
        if n == 0:
            return
        device = kv_caches[0].device
        num_blocks = kv_caches[0].shape[1]
        pad = next_power_of_two(n) - n if device.type == "xla" else 0
        pairs = pairs.cpu()
        src = torch.cat([pairs[:, 0], pairs.new_zeros(pad)]).to(device)
        dst = torch.cat([pairs[:, 1], pairs.new_full((pad,), num_blocks)]).to(device)
        for cache in kv_caches:  # [1, num_blocks, block_size, 2*kvH, D]
            cache.index_copy_(1, dst, cache.index_select(1, src))
        if device.type == "xla":
            import torch_xla

            torch_xla.sync()

    def warm_up(self, kv_caches: list[torch.Tensor], counts: list[int]) -> None:
        """Compile the copy program of each pair count (all pairs out of range: no effect)."""
        num_blocks = kv_caches[0].shape[1]
        for n in counts:
            pairs = torch.tensor([[0, num_blocks]] * n, dtype=torch.int64)
            self.copy_blocks(kv_caches, pairs)

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        if pairs.numel():
            raise NotImplementedError("the tpu backend does not swap KV blocks to host memory "
                                      "(capabilities.swap=False): the scheduler preempts by "
                                      "recompute, so no swap should reach the worker")
