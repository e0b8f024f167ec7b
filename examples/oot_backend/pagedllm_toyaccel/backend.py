"""The toyaccel backend class: identity, availability, capabilities, and its three parts.

toyaccel stands for an accelerator whose compiler wants static shapes and whose memory is a
fixed arena. It runs on the host CPU (torch device "cpu") so this example works anywhere, but
every choice below is one a real port makes:

* its own KV-cache layout, heads-major ([2, blocks, kv_heads, block_size, head_size]), and its
  own attention (attention.py): one blockwise online-softmax kernel for prefill and decode;
* cache copy/swap: the layout keeps blocks on dim 1, so the contract's reference ``CacheOps``
  already works and is not overridden;
* its own worker (worker.py), named by import string (``worker_class``, so the backend module
  stays light): pads every step to a power-of-two bucket (static shapes) and sizes the KV cache
  from the device arena;
* capabilities it declares honestly: no chunked prefill, float32/bfloat16 only, block sizes 16
  and 32. The engine refuses configurations outside them, and the conformance suite skips (and
  reports) the checks for what is not declared.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.attention import AttentionImpl

DISABLE_ENV = "TOYACCEL_DISABLE"  # set to 1 to make the device "absent" (shows availability)


class ToyAccelBackend(Backend):
    name = "toyaccel"  # must equal the entry-point name in pyproject.toml
    torch_device = "cpu"  # a real port names its device: "xla", "xpu", "hpu", "privateuseone" ...
    dist_backend = "gloo"
    default_dtype = "float32"
    plugin_api_version = "2.1"  # the pagedllm plugin API this port was written for
    capabilities = Capabilities(graphs=False, swap=True, static_shapes=True, prefix_caching=True,
                                chunked_prefill=False, dtypes=("float32", "bfloat16"),
                                preferred_block_size=16, block_sizes=(16, 32),
                                head_sizes=(64, 80, 96, 112, 128, 256), max_gqa_group=8)
    worker_class = "pagedllm_toyaccel.worker:ToyAccelWorker"  # imported when a worker starts

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        # A real port probes its runtime here (import the SDK lazily, count devices) and returns
        # the reason a user should read when --device toyaccel cannot run. Never raise.
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            return False, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        return True, "toy accelerator emulated on the host CPU"

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "blockwise"
        if choice != "blockwise":
            raise ValueError(f"attention_backend={choice!r} is not available on toyaccel; "
                             "allowed: blockwise")
        from pagedllm_toyaccel.attention import BlockwiseAttention

        return BlockwiseAttention
