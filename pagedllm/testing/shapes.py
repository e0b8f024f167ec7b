"""The attention sweep's space and the steps it builds (issue 41, item 1).

Dimensions: every declared dtype, KV-cache dtype, block size, head size and attention feature
(plus "none"); KV heads 1, 3 and 8; GQA groups 1, an odd one and the declared maximum; and one
of four *shape classes*, each a whole engine step:

- ``decode``: 67 decodes (past every grid of 16, 32 or 64 sequences, with distinct block tables,
  lengths at and around block boundaries) plus one prefill, their blocks taken from the top of a
  realistically sized pool (block ids past 32,767 and 65,535 where the memory allows), padded;
- ``prefill``: a prompt of 3 x max(largest block size, 64) + 37 tokens and, where cached context
  is declared, a long chunk over context, plus decodes;
- ``chunks``: where cached context is declared, one short chunk starting at *every* offset
  inside a block (fresh prompts ending at spread offsets otherwise), plus decodes;
- ``long``: a decode at the longest context (16,411 tokens when no ``max_context_len`` is
  declared, else that) and a chunk (or a prompt) at the far end of another such sequence.

8 KV heads are swept in the ``decode`` class only, and 3 KV heads never meet the largest group
(where it is above 5): with the long classes they would multiply the float64 reference's cost,
not the paths a kernel takes (KV heads index the same way at any length).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.testing.paged_batch import SeqSpec
from pagedllm.testing.space import Space, exclude, extremes_and_odd

if TYPE_CHECKING:
    from pagedllm.contract.capabilities import Capabilities

DECODE, PREFILL, CHUNKS, LONG = "decode", "prefill", "chunks", "long"
SHAPE_CLASSES = (DECODE, PREFILL, CHUNKS, LONG)
KV_HEADS = (1, 3, 8)
WIDE_DECODES = 67  # past 16, 32 and 64 sequences, a multiple of none
LONG_CONTEXT = 16411  # past 16k tokens, a multiple of no block size or tile
POOL_BLOCKS = 70001  # a realistic pool of small blocks: ids past int16 and uint16
NO_FEATURE = "none"
SOFT_CAP = 7.5
# fp8 KV cache: per-tensor scales other than 1 (a checkpoint's k_scale / v_scale)
FP8_K_SCALE, FP8_V_SCALE = 0.37, 2.5


def max_group(caps: Capabilities) -> int:
    return 8 if caps.max_gqa_group is None else caps.max_gqa_group


def groups(caps: Capabilities) -> list[int]:
    """1, an odd group that is not a power of two (5, else 3) and the declared maximum."""
    top = max_group(caps)
    odd = 5 if top >= 5 else 3 if top >= 3 else None
    return sorted({1, top} | ({odd} if odd else set()))


def cached_context(caps: Capabilities) -> bool:
    return caps.prefix_caching or caps.chunked_prefill


def attention_space(caps: Capabilities, features: tuple[str, ...] | None = None,
                    kv_cache_dtypes: tuple[str, ...] | None = None) -> Space:
    """The space of test_sweep.test_attention_sweep for a backend declaring ``caps``
    (``features`` / ``kv_cache_dtypes``: what the chosen attention implementation takes, when
    narrower than the backend's declaration)."""
    features = caps.attention_features if features is None else features
    kv = caps.kv_cache_dtypes if kv_cache_dtypes is None else kv_cache_dtypes
    dims: dict[str, list[Any]] = {
        "dtype": list(caps.dtypes),
        "kv_cache": list(dict.fromkeys(kv or ("auto",))),
        "block_size": sorted(caps.block_sizes),
        "head_size": sorted(caps.head_sizes),
        "feature": [NO_FEATURE, *features],
        "kv_heads": list(KV_HEADS),
        "group": groups(caps),
        "shape": list(SHAPE_CLASSES),
    }
    top = max_group(caps)
    reps = {"block_size": sorted({min(caps.block_sizes), max(caps.block_sizes)}),
            "head_size": extremes_and_odd(caps.head_sizes)}
    # what makes a step expensive (memory moved, the float64 reference): the free choices of a
    # case take the cheapest values that cover as much
    cost = {"kv_heads": {k: k for k in KV_HEADS}, "group": {g: g for g in dims["group"]},
            "head_size": {h: h for h in dims["head_size"]},
            "block_size": {b: b for b in dims["block_size"]}, "kv_cache": {"fp8": 4.0}}
    return Space(dims, reps=reps, cost=cost, excluded=exclude([("kv_heads", 8, "shape", PREFILL), ("kv_heads", 8, "shape", LONG)]
                               + ([("kv_heads", 3, "group", top)] if top > 5 else [])))


def window(block_size: int) -> int:
    """The sliding window of a case: two blocks and a bit, so it ends mid-block."""
    return 2 * block_size + 5


def prompt_len(caps: Capabilities) -> int:
    """The long prompt: three tiles of the largest block size (or of 64), plus 37."""
    n = 3 * max(max(caps.block_sizes), 64) + 37
    return min(n, caps.max_context_len) if caps.max_context_len else n


def long_context(caps: Capabilities) -> int:
    return caps.max_context_len if caps.max_context_len is not None else LONG_CONTEXT


def _cap(specs: list[SeqSpec], limit: int | None) -> list[SeqSpec]:
    """``specs`` with every sequence shortened to ``limit`` tokens (keeping its query)."""
    if limit is None:
        return specs
    out = []
    for s in specs:
        q = min(s.query_len, limit)
        out.append(SeqSpec(max(0, min(s.context_len, limit - q)), q))
    return out


def step(shape: str, caps: Capabilities, bs: int) -> list[SeqSpec]:
    """The sequences of one step of a shape class (multi-token entries first)."""
    cached = cached_context(caps)
    if shape == DECODE:
        first = SeqSpec(bs + 3, 2) if cached else SeqSpec(0, 3)
        # lengths at and around block boundaries, one across several blocks, the rest short
        edges = [1, bs - 1 or 1, bs, bs + 1, 2 * bs + 3, 4 * bs + 7]
        lens = edges + [2 + (i * 7) % 29 for i in range(WIDE_DECODES - len(edges))]
        specs = [first] + [SeqSpec(n - 1, 1) for n in lens]
    elif shape == PREFILL:
        n = prompt_len(caps)
        specs = [SeqSpec(0, n)]
        if cached:
            specs.append(SeqSpec(2 * bs + 3, n // 3 + 1))  # a long chunk over context
        specs += [SeqSpec(bs, 1), SeqSpec(n - 1, 1), SeqSpec(0, 1)]
    elif shape == CHUNKS:
        if cached:  # a short chunk starting at every offset inside a block (ending at others)
            specs = [SeqSpec(o if o else bs, 2 + o % 5) for o in range(bs)]
        else:  # fresh prompts ending at spread offsets of their last block
            specs = [SeqSpec(0, o + 2) for o in range(0, bs, max(1, bs // 16))]
        specs += [SeqSpec(bs, 1), SeqSpec(2 * bs - 1, 1), SeqSpec(0, 1)]
    elif shape == LONG:
        n = long_context(caps)
        far = SeqSpec(n - 8, 8) if cached else SeqSpec(0, min(n, 300))
        specs = [far, SeqSpec(n - 1, 1), SeqSpec(0, 1)]
    else:
        raise ValueError(f"shape={shape!r}: expected one of {', '.join(SHAPE_CLASSES)}")
    specs = _cap(specs, caps.max_context_len)
    multi = [s for s in specs if s.query_len > 1]
    return multi + [s for s in specs if s.query_len == 1]


def pool_blocks(shape: str, needed: int, block_bytes: int, lazy: bool) -> int | None:
    """The pool a ``decode`` step's blocks come from the top of: POOL_BLOCKS where ``lazy``
    (host memory mapped on first touch) allows 2 GiB of cache, else 256 MiB; None for the other
    classes (a pool just big enough, shuffled)."""
    if shape != DECODE:
        return None
    budget = (2 << 30) if lazy else (256 << 20)
    return max(needed + 8, min(POOL_BLOCKS, budget // max(1, block_bytes)))
