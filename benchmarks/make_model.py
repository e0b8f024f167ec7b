"""Write a random-weight Hugging Face checkpoint (Llama, Mixtral, Gemma-2, Qwen3) plus a tokenizer.

    python benchmarks/make_model.py OUT_DIR [--preset bench99m|tiny|mixtral-moe-100m|...]
                                            [--dtype float32|bfloat16] [--seed 0]

The folder loads offline with ``AutoTokenizer`` / ``AutoModelForCausalLM`` (transformers),
with vLLM, and with pagedllm.  The ``*-shape`` presets write only config.json and the tokenizer,
for engines that build random weights themselves (``load_format="dummy"``).  Each preset's
config is built with transformers' own config class of its architecture.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("make_model")

# Token ids of the special tokens; every other id is a plain word "t<id>".
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}

PRESETS: dict[str, dict[str, Any]] = {
    # 8 x 11.27M (layers) + 2 x 4096 x 1024 (embed + untied lm_head) = 98.6M parameters.
    "bench99m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, intermediate_size=2816, vocab_size=4096,
                     max_position_embeddings=2048),
    # head_dim 64: vLLM's CPU attention rejects head_dim 16.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=352, vocab_size=512,
                 max_position_embeddings=512),
    "llama3-8b-shape": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                            max_position_embeddings=8192, rope_theta=500000.0),
    # 7 x (8 experts x 3 x 512 x 1024 + 0.66M attention) + 2 x 4096 x 512 = 96.8M parameters,
    # 8 experts top-2 (about 27M active per token). head_dim 64.
    "mixtral-moe-100m": dict(arch="mixtral", hidden_size=512, num_hidden_layers=7,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                             vocab_size=4096, max_position_embeddings=2048, rope_theta=1e6),
    # 11 x 8.65M + 4096 x 768 (tied) = 98.3M parameters; every other layer slides over 128
    # tokens (shorter than the variable workload's contexts, so the window is exercised),
    # attention logits capped at 50 and final logits at 30 (Gemma-2's values).
    "gemma2-100m": dict(arch="gemma2", hidden_size=768, num_hidden_layers=11,
                        num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                        intermediate_size=3072, vocab_size=4096, max_position_embeddings=2048,
                        sliding_window=128, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, query_pre_attn_scalar=64),
    # Mixtral-8x7B's full shape, all 32 layers: 46.7B parameters = 93.4 GB in bfloat16, which
    # fits one H200 (141 GB) with ~35 GB left for the KV cache and activations. Config only.
    "mixtral-8x7b-shape": dict(arch="mixtral", hidden_size=4096, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               intermediate_size=14336, num_local_experts=8,
                               num_experts_per_tok=2, vocab_size=32000,
                               max_position_embeddings=32768, rope_theta=1e6),
    # Qwen3-8B's shape (8.2B parameters, 16.4 GB bf16), q/k RMSNorm, untied head. Config only.
    "qwen3-8b-shape": dict(arch="qwen3", hidden_size=4096, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           intermediate_size=12288, vocab_size=151936,
                           max_position_embeddings=40960, rope_theta=1e6),
}
CONFIG_ONLY = {"llama3-8b-shape", "mixtral-8x7b-shape", "qwen3-8b-shape"}
# arch -> (transformers config class, architectures entry, ties embeddings)
ARCHES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
}


def make_config(preset: str, dtype: str) -> Any:
    """The config of ``preset``, built by its architecture's transformers config class
    (initializer_range 0.02, bos=1, eos=2; embeddings tied only for Gemma-2)."""
    import transformers

    kwargs = dict(PRESETS[preset])
    arch = kwargs.pop("arch", "llama")
    class_name, architecture, tied = ARCHES[arch]
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    # transformers 5 keeps rope_theta inside rope_parameters; the keyword still sets it there.
    config = getattr(transformers, class_name)(
        **kwargs, rope_theta=rope_theta, initializer_range=0.02, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, tie_word_embeddings=tied)
    config.architectures = [architecture]
    config.dtype = dtype
    return config


def make_tokenizer(vocab_size: int) -> Any:
    """A WordLevel tokenizer whose vocab is exactly ``vocab_size`` ids: specials, then t3, t4..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size={vocab_size} must exceed the {len(SPECIALS)} special tokens")
    vocab = dict(SPECIALS)
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>",
                                   model_max_length=1 << 20)


def count_parameters(config: Any) -> int:
    """Parameter count of a model with this config, without building it: by hand for a Llama
    (no biases), from a weightless (meta-device) build for the other architectures."""
    if config.model_type != "llama":
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * layer + embed + h


def write_checkpoint(out_dir: Path, preset: str, dtype: str, seed: int) -> Path:
    """Write config + tokenizer (+ seeded random safetensors weights) to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = make_config(preset, dtype)
    logger.info("preset %s: %.1fM parameters (vocab %d)", preset,
                count_parameters(config) / 1e6, config.vocab_size)
    make_tokenizer(config.vocab_size).save_pretrained(out_dir)
    generation = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, do_sample=False)
    if preset in CONFIG_ONLY:
        config.save_pretrained(out_dir)
        generation.save_pretrained(out_dir)
        logger.info("wrote config + tokenizer only (use load_format='dummy') to %s", out_dir)
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.generation_config = generation
    built = sum(p.numel() for p in model.parameters())
    if built != count_parameters(config):
        raise RuntimeError(f"built {built} parameters, expected {count_parameters(config)}")
    model.save_pretrained(out_dir)
    logger.info("wrote %s weights (seed %d) to %s", dtype, seed, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench99m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",  # pagedllm.logger's
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_checkpoint(args.out_dir, args.preset, args.dtype, args.seed)


if __name__ == "__main__":
    main()
