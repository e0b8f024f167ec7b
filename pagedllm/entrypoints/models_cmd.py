"""`pagedllm models`: every supported architecture, the attention features it can need, and the
backends whose declared capabilities can run it."""
from __future__ import annotations

import argparse


def models_table() -> list[list[str]]:
    """Rows [architecture, features, backends]; the first row is the header. A backend counts
    when it loads and declares every feature of the family (``Capabilities.attention_features``)."""
    from pagedllm.backends.registry import discover
    from pagedllm.models.registry import MODEL_REGISTRY

    backends = [info for info in discover().values() if info.cls is not None]
    rows = [["architecture", "attention features", "backends"]]
    for arch in sorted(MODEL_REGISTRY):
        features = MODEL_REGISTRY[arch].features
        able = [b.name for b in backends
                if set(features) <= set(b.cls.capabilities.attention_features)]
        rows.append([arch, ",".join(features) or "-", ",".join(able) or "none"])
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list supported model architectures and the backends that "
                                      "can run them")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.backends_cmd import format_table

    print(format_table(models_table()))
    return 0
