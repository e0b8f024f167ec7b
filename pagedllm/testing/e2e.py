"""End-to-end pieces of the suite: a small checkpoint, prompts, and Hugging Face's greedy output.

The checkpoint is a random-weight Llama with grouped-query attention (4 query heads, 2 KV heads)
and head size 64, a shape every paged-attention kernel supports. Prompt lengths are tied to the
block size so that, whatever the backend's preferred block size, prompts end mid-block, cross
block boundaries while decoding, and share whole blocks of prefix.
"""
from __future__ import annotations

import random
from typing import Any

import torch

MAX_TOKENS = 16
CHECKPOINT_CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, num_hidden_layers=2, max_position_embeddings=1024)


def make_conformance_checkpoint(path: str, family: str = "llama", **overrides: Any) -> str:
    """The suite's checkpoint; another ``family`` (e.g. "mistral" with ``sliding_window``,
    "gemma2") keeps its attention shape (head size 64, 4 query heads over 2 KV heads)."""
    from pagedllm.testing.checkpoints import make_checkpoint

    return make_checkpoint(path, family, seed=0, **{**CHECKPOINT_CONFIG, **overrides})


def prompts(block_size: int) -> list[list[int]]:
    """Token-id prompts. The first ends 3 tokens short of a block boundary (decode then needs a
    new block, which forces preemption in a tight cache); the last two share ``2*block_size``
    tokens (whole blocks of prefix for prefix caching)."""
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randint(3, 258) for _ in range(n)]

    base = rand(2 * block_size + 8)
    return [rand(2 * block_size - 3), *(rand(n) for n in (5, 17, 33, 2, 64)),
            base, base[:2 * block_size] + [7, 8, 9]]


def blocks_needed(block_size: int) -> int:
    """KV blocks the longest sequence of ``prompts`` needs once MAX_TOKENS are generated."""
    return max(-(-(len(p) + MAX_TOKENS) // block_size) for p in prompts(block_size))


def hf_greedy(path: str, ps: list[list[int]]) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt (float32, CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    kwargs: dict = {}
    if getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None):
        # transformers 4.x's SDPA path leaves the attention soft cap out (Gemma 2); eager has it
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    # transformers 5 applies the checkpoint's generation_config eos even when the passed config
    # says None; the engine runs with ignore_eos
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in ps]


def engine_greedy(llm: Any, ps: list[list[int]]) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def first_mismatch(got: list[list[int]], expected: list[list[int]]) -> str:
    """A readable description of where two token lists first differ ('' when equal)."""
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            at = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
            return (f"prompt {i}: first different token at output position {at}: "
                    f"got {g[at:at + 5]}, transformers {e[at:at + 5]}")
    return "" if len(got) == len(expected) else f"{len(got)} outputs for {len(expected)} prompts"
