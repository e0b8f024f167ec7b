"""Adapters made by the ``peft`` library itself on the tests' random-weight checkpoints, and
transformers + PEFT greedy references (tests/lora)."""
from __future__ import annotations

import random
from typing import Any

import torch

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_TOKENS = 12
GREEDY_TOKENS = MAX_TOKENS


def make_adapter(base: str, out: str, targets: tuple[str, ...] | list[str] = DENSE_TARGETS,
                 r: int = 8, alpha: float = 16, seed: int = 0, use_rslora: bool = False,
                 scale: float = 4.0, **lora_kwargs: Any) -> str:
    """A PEFT LoRA adapter for the checkpoint at ``base``, saved to ``out``: random A and B
    (init_lora_weights=False), scaled by ``scale`` so the adapter changes greedy tokens."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=use_rslora, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    peft_model.save_pretrained(out)
    return out


def hf_lora_greedy(base: str, adapter: str | None, ps: list[list[int]],
                   max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers (+ PEFT's adapter when given) greedy continuations, float32, EOS ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([p]),
                               generation_config=cfg)[0, len(p):].tolist() for p in ps]


def lora_prompts(vocab: int = 259, seed: int = 0) -> list[list[int]]:
    """Prompts of 3 to 40 tokens; the last two share a 32-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    base = [rng.randint(3, vocab - 1) for _ in range(40)]
    mixed = [[rng.randint(3, vocab - 1) for _ in range(n)] for n in (5, 19, 3)]
    return mixed + [base, base[:32] + [7, 8, 9]]
