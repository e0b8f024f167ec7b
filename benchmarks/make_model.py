"""Write a random-weight Hugging Face Llama checkpoint plus a matching tokenizer.

    python benchmarks/make_model.py OUT_DIR [--preset bench99m|tiny|llama3-8b-shape]
                                            [--dtype float32|bfloat16] [--seed 0]

The folder loads offline with ``AutoTokenizer`` / ``AutoModelForCausalLM`` (transformers),
with vLLM, and with pagedllm.  ``llama3-8b-shape`` writes only config.json and the tokenizer,
for engines that build random weights themselves (``load_format="dummy"``).
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
}
CONFIG_ONLY = {"llama3-8b-shape"}


def make_config(preset: str, dtype: str) -> Any:
    """The LlamaConfig of ``preset`` (initializer_range 0.02, bos=1, eos=2, untied)."""
    from transformers import LlamaConfig

    kwargs = dict(PRESETS[preset])
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    config = LlamaConfig(**kwargs, rope_theta=rope_theta, initializer_range=0.02,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
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
    """Parameter count of a Llama with this config (no biases), without building it."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * layer + embed + h


def write_checkpoint(out_dir: Path, preset: str, dtype: str, seed: int) -> Path:
    """Write config + tokenizer (+ seeded random safetensors weights) to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

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
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
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
