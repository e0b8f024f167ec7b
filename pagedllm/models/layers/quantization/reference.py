"""Old import path of the quantized linear's reference: re-exports ``pagedllm.reference.quant``."""
from pagedllm.reference.quant import (column_groups, dequantize_weight, fp8_per_token, quant_linear,
                                      quant_linear_prepare)

__all__ = ["column_groups", "dequantize_weight", "fp8_per_token", "quant_linear",
           "quant_linear_prepare"]
