"""Every registered dense family runs PEFT adapters on its linears (this engine's fused q/k/v and
gate/up, Phi-3's and GPT-2's HF-fused ones split, GPT-NeoX's interleaved q/k/v, GPT-2's Conv1D),
Mixtral and Qwen3-MoE attention-only adapters: greedy tokens equal transformers + PEFT, an
adapter and the base model in one batch (chunked prefill on)."""
from __future__ import annotations

import pytest

from lora_helpers import ATTENTION_TARGETS, DENSE_TARGETS, hf_lora_greedy, lora_prompts, \
    make_adapter
from pagedllm import LLM, LoRARequest, SamplingParams

FAMILY_TARGETS = {
    "qwen2": DENSE_TARGETS,
    "mistral": DENSE_TARGETS,
    "qwen3": DENSE_TARGETS,
    "gemma2": DENSE_TARGETS,
    "gemma3": DENSE_TARGETS,
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "mixtral": ATTENTION_TARGETS,
    "qwen3_moe": ATTENTION_TARGETS,
}
TOKENS = 8


@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_family_matches_transformers_peft(family: str, checkpoint_factory, tmp_path) -> None:
    base = checkpoint_factory(family)
    adapter = make_adapter(base, str(tmp_path / family), targets=FAMILY_TARGETS[family], r=8,
                           seed=len(family))
    ps = lora_prompts()[:3]
    want_base = hf_lora_greedy(base, None, ps, TOKENS)
    want = hf_lora_greedy(base, adapter, ps, TOKENS)
    assert want != want_base  # the adapter matters
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_model_len=128,
              enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        req = LoRARequest(family, 1, adapter)
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps * 2], params, use_tqdm=False,
                            lora_request=[req] * len(ps) + [None] * len(ps))
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got[:len(ps)] == want
        assert got[len(ps):] == want_base
    finally:
        llm.shutdown()


def test_moe_expert_adapters_are_refused(checkpoint_factory, tmp_path) -> None:
    """PEFT (on transformers 5) targets fused experts through target_parameters; adapters of the
    older per-expert layout name expert linears: both refused, naming what."""
    import json

    import torch
    from safetensors.torch import save_file

    from pagedllm.lora.peft import LoRAAdapterError

    base = checkpoint_factory("qwen3_moe")
    peft_made = make_adapter(base, str(tmp_path / "experts"), targets=("gate_proj", "up_proj"),
                             r=4)
    old = tmp_path / "old"
    old.mkdir()
    (old / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                         "lora_alpha": 8}))
    module = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{module}.lora_A.weight": torch.zeros(4, 64),
               f"{module}.lora_B.weight": torch.zeros(32, 4)},
              str(old / "adapter_model.safetensors"))
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_model_len=128,
              max_num_batched_tokens=128, max_num_seqs=8)
    try:
        with pytest.raises(LoRAAdapterError, match=r"target_parameters=\['gate_up_proj'\] is "
                                                   r"not supported"):
            llm.llm_engine.add_lora(LoRARequest("experts", 1, peft_made))
        with pytest.raises(LoRAAdapterError, match=r"mlp\.experts\.0\.gate_proj' is "
                                                   r"ExpertWeights here, not a linear layer"):
            llm.llm_engine.add_lora(LoRARequest("old", 2, str(old)))
    finally:
        llm.shutdown()
