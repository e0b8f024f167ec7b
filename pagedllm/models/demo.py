"""The built-in default model: a small Llama trained by the project to complete Python code.

It ships inside the package (``pagedllm/models/demo_model/``), so ``pagedllm generate`` and
``pagedllm serve`` show real text with no download. How it was made, and how well it does, is
in that folder's README.md; tools/train_demo_model.py rebuilds it.
"""
from __future__ import annotations

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def missing_files(path: str = DEMO_DIR) -> list[str]:
    """The files a usable demo folder needs that ``path`` lacks (a checkout without weights)."""
    return [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]


def demo_model_path() -> str:
    """The shipped folder; an error that says how to get the weights when they are not there."""
    missing = missing_files()
    if missing:
        raise ValueError(
            f"the built-in model folder {DEMO_DIR} lacks {', '.join(missing)}; reinstall pagedllm "
            "from a release, or train it with `python tools/train_demo_model.py --out "
            f"{DEMO_DIR}`, or pass --model with a local Hugging Face checkpoint folder")
    return DEMO_DIR
