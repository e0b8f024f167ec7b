"""Old import path of ``TorchPagedAttention``, the reference paged attention (once the cpu
backend's own): re-exports ``pagedllm.reference.attention``."""
from pagedllm.reference.attention import TorchPagedAttention, gather_kv, masked_attention, to_fp8

__all__ = ["TorchPagedAttention", "gather_kv", "masked_attention", "to_fp8"]
