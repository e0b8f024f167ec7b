"""Tokenizer loading (local folders only) and the end-of-sequence ids a model stops on."""
from __future__ import annotations

import json
import os
from typing import Any


def get_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path!r}: {exc}") from exc


def stop_token_ids_of(tokenizer: Any, model_path: str) -> set[int]:
    """EOS ids from the tokenizer and from generation_config.json (which may list several)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids
