"""``--lora-modules`` values (vLLM's forms), parsed without the server's web stack: the CLI's
parser is built where only the engine's dependencies are installed (the tpu and xpu venvs)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``
    (argparse type of --lora-modules)."""
    import argparse

    text = value.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModulePath(str(spec["name"]), str(spec["path"]),
                                  spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(
                f"--lora-modules {value!r}: JSON needs 'name' and 'path' ({exc})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r} is invalid: give "
                                         "name=path (or JSON with name and path)")
    return LoRAModulePath(name, path)
