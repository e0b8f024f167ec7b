"""Old import path of the op table and its torch references: re-exports ``pagedllm.reference.ops``
(the table's spec is ``pagedllm.contract.ops``)."""
from pagedllm.reference.ops import (Ops, apply_token_bitmask, fused_moe, fused_moe_prepare,
                                    gelu_tanh_and_mul, gemma_rms_norm, greedy_logprobs, linear,
                                    linear_prepare, quant_linear, quant_linear_prepare, rms_norm,
                                    rotary, silu_and_mul)

__all__ = ["Ops", "apply_token_bitmask", "fused_moe", "fused_moe_prepare", "gelu_tanh_and_mul",
           "gemma_rms_norm", "greedy_logprobs", "linear", "linear_prepare", "quant_linear",
           "quant_linear_prepare", "rms_norm", "rotary", "silu_and_mul"]
