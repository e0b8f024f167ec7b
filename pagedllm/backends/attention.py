"""Old import path of the attention part of the plugin contract: re-exports
``pagedllm.contract.attention`` (where new code imports from)."""
from pagedllm.contract.attention import ATTENTION_FEATURES, AttentionImpl, AttentionMetadata

__all__ = ["ATTENTION_FEATURES", "AttentionImpl", "AttentionMetadata"]
