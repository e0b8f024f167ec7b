"""Which values of each declared attention limit the suite runs (item 1 of issue 29).

The sweep is sampled, not enumerated: one dimension varies at a time (every declared block size,
every candidate head size, every GQA group up to the declared maximum) while the others stay at
a small default shape, so one backend's whole suite stays within a few minutes on two CPU cores.
Values a backend does not declare are still parametrized, then skipped and reported as NOT
DECLARED by the pytest plugin (see ``limit_needs``), so the report says what was left out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.contract.capabilities import Capabilities

# head sizes models ship with (Phi-2 80, Falcon/GPT-J 96, 112 some Qwen variants, Gemma 256)
CANDIDATE_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 256)
# query heads per KV head; 3, 5 and 6 catch "the group is a power of two" assumptions
CANDIDATE_GQA_GROUPS = (1, 2, 3, 4, 5, 6, 8)
# the longest context the sweep reaches (capped by max_context_len when one is declared)
LONG_CONTEXT = 4100
# scales other than head_size ** -0.5 (Gemma's query_pre_attn_scalar, muP, T5's 1.0)
CUSTOM_SCALES = (0.03, 1.0)
# limit-need prefixes the plugin understands, besides Capabilities fields and dtype:NAME
HEAD_SIZE, GQA_GROUP, FEATURE, KV_CACHE_DTYPE = "head_size:", "gqa_group:", "feature:", "kv_cache:"
QUANTIZATION = "quantization:"


def head_sizes(caps: Capabilities | None) -> list[int]:
    """Every candidate head size plus any other size the backend declares."""
    declared = tuple(caps.head_sizes) if caps is not None else ()
    return sorted(set(CANDIDATE_HEAD_SIZES) | set(declared))


def gqa_groups(caps: Capabilities | None) -> list[int]:
    return list(CANDIDATE_GQA_GROUPS)


def long_context(caps: Capabilities) -> int:
    """The longest sequence the sweep builds: LONG_CONTEXT, or the declared maximum."""
    if caps.max_context_len is not None:
        return min(LONG_CONTEXT, caps.max_context_len)
    return LONG_CONTEXT


def default_head_size(caps: Capabilities) -> int:
    """The shape the other dimensions are swept at: 64 when declared, else the first declared."""
    return 64 if 64 in caps.head_sizes else sorted(caps.head_sizes)[0]


def default_heads(caps: Capabilities) -> tuple[int, int]:
    """(num_heads, num_kv_heads) for the non-GQA dimensions: group 2, or 1 where that is all."""
    group = 2 if caps.max_gqa_group is None or caps.max_gqa_group >= 2 else 1
    return 2 * group, 2


def has_limit(caps: Capabilities, need: str) -> bool | None:
    """Whether ``need`` (one of the prefixes above) is declared; None if it is not a limit need."""
    if need.startswith(HEAD_SIZE):
        return int(need[len(HEAD_SIZE):]) in caps.head_sizes
    if need.startswith(GQA_GROUP):
        group = int(need[len(GQA_GROUP):])
        return caps.max_gqa_group is None or group <= caps.max_gqa_group
    if need.startswith(FEATURE):
        return need[len(FEATURE):] in caps.attention_features
    if need.startswith(KV_CACHE_DTYPE):
        return need[len(KV_CACHE_DTYPE):] in caps.kv_cache_dtypes
    if need.startswith(QUANTIZATION):
        return need[len(QUANTIZATION):] in caps.quantizations
    return None


def limit_label(need: str) -> str:
    """How a need reads in the summary: 'head size 80', 'GQA group 6', 'sliding_window' ..."""
    for prefix, label in ((HEAD_SIZE, "head size "), (GQA_GROUP, "GQA group "),
                          (FEATURE, ""), (KV_CACHE_DTYPE, "kv cache "),
                          (QUANTIZATION, "quantization ")):
        if need.startswith(prefix):
            return label + need[len(prefix):]
    return need
