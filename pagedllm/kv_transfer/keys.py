"""Content keys of KV blocks, stable across processes and runs: the prefix cache's keys, and the
keys KV offload tiers and KV connectors store blocks under. No torch here.

A block's key is a 16-byte BLAKE2b digest of its parent's key and its token ids; the first
block's parent is the root, the digest of a namespace (what else changes the KV of the same
tokens: the model, its dtype, the KV-cache dtype, the block size, the layout of the shards) and
the request's adapter. So equal keys mean equal KV wherever they were computed, and a key
names its whole prefix (a chain), as vLLM's block hashes do. Python's ``hash()`` is not used:
it is salted per process for strings and None.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

KEY_BYTES = 16


def root_key(namespace: str, lora_int_id: int = 0) -> bytes:
    """The parent of a sequence's first block: the namespace and the adapter (0: none)."""
    return blake2b(f"{namespace}|lora={lora_int_id}".encode(), digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block holding ``token_ids`` after the prefix keyed ``parent``."""
    h = blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()
