"""Old import path of the ``fused_moe`` reference: re-exports ``pagedllm.reference.moe``."""
from pagedllm.reference.moe import (check_shapes, expert_mlp, fused_moe, fused_moe_dense,
                                    fused_moe_grouped, fused_moe_prepare, group_by_expert,
                                    run_grouped, select_experts)

__all__ = ["check_shapes", "expert_mlp", "fused_moe", "fused_moe_dense", "fused_moe_grouped",
           "fused_moe_prepare", "group_by_expert", "run_grouped", "select_experts"]
