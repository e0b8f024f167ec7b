"""Tiny random-weight Hugging Face checkpoints (safetensors + tokenizer) for tests and benchmarks."""
from __future__ import annotations

import os
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: ids 0-2 are specials, then the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# family -> (transformers config class, overrides of the common tiny shape)
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 80 (not hidden / heads), 6 query heads over 2 KV heads (GQA group 3)
    "qwen3": ("Qwen3Config", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=80,
                                  intermediate_size=128, rms_norm_eps=1e-6,
                                  tie_word_embeddings=False)),
    # LongRoPE switching to its long factors at 70 tokens (prompts up to 64 tokens,
    # continuations past 70), half of each 32-channel head rotated
    "phi3": ("Phi3Config", dict(hidden_size=128, num_key_value_heads=2, intermediate_size=128,
                                rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0,
                                original_max_position_embeddings=70, rope_parameters=dict(
                                    rope_type="longrope", rope_theta=10000.0,
                                    partial_rotary_factor=0.5,
                                    short_factor=[1.0 + 0.05 * i for i in range(8)],
                                    long_factor=[1.2 + 0.4 * i for i in range(8)]))),
    # 8 experts, top 2, head_dim 96 (not hidden / heads)
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, head_dim=96, intermediate_size=64,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      rms_norm_eps=1e-5, sliding_window=None)),
    # GQA group 3; layer 0 sparse (8 experts, top 2, weights not renormalized), layer 1 dense
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=6, num_key_value_heads=2,
                                         head_dim=16, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False,
                                         decoder_sparse_step=1, mlp_only_layers=[1],
                                         rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # learned positions, Conv1D weights, tied head, gelu_new
    "gpt2": ("GPT2Config", dict(activation_function="gelu_new", pad_token_id=0)),
    # parallel residual, a quarter of each 16-channel head rotated
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=128, rotary_pct=0.25,
                                       use_parallel_residual=True, pad_token_id=0)),
    # sliding layers (window 6) alternate with global ones; soft caps small enough to matter;
    # query_pre_attn_scalar != head_dim
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                    query_pre_attn_scalar=24, sliding_window=6,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                    num_hidden_layers=3)),
    # local rope base 10k on sliding layers (window 5), 1M with linear scaling on global ones
    "gemma3": ("Gemma3TextConfig", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=128, query_pre_attn_scalar=24,
        sliding_window=5, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}})),
}


def tiny_config(arch: str = "llama", vocab_size: int = 259, **overrides: Any) -> Any:
    """A small config of the given family ("llama", "qwen2", "mistral", "opt")."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2)
    if arch == "opt":
        cfg = dict(common, ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=True,
                   pad_token_id=0, enable_bias=True)
        cfg.update(overrides)
        return tf.OPTConfig(**cfg)
    if arch in FAMILY_CONFIGS:  # the families of issue 31 (odd head sizes, GQA group 3, MoE)
        cls_name, family = FAMILY_CONFIGS[arch]
        return getattr(tf, cls_name)(**{**common, **family, **overrides})
    cfg = dict(common, num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-6)
    if arch == "qwen2":
        cfg["tie_word_embeddings"] = True
    cfg.update(overrides)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
    return cls(**cfg)


def make_checkpoint(path: str, arch: str = "llama", seed: int = 0, init_std: float = 0.05,
                    **overrides: Any) -> str:
    """Write a random-weight checkpoint of ``arch`` to ``path`` (float32, safetensors)."""
    import torch
    import transformers as tf

    config = tiny_config(arch, **overrides)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path
