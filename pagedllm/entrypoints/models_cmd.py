"""`pagedllm models`: every supported architecture, the attention features it can need, and the
backends whose declared capabilities can run it."""
from __future__ import annotations

import argparse


def models_table() -> list[list[str]]:
    """Rows [architecture, features, backends for every config, backends only for configs that
    leave the features off]; the first row is the header. A backend counts when it loads; it
    runs every config when it declares each feature (``Capabilities.attention_features``)."""
    from pagedllm.contract.registry import discover
    from pagedllm.models.registry import MODEL_REGISTRY

    backends = [info for info in discover().values() if info.cls is not None]
    rows = [["architecture", "attention features", "backends", "only without them"]]
    for arch in sorted(MODEL_REGISTRY):
        features = set(MODEL_REGISTRY[arch].features)
        full = [b.name for b in backends
                if features <= set(b.cls.capabilities.attention_features)]
        partial = [b.name for b in backends if b.name not in full]
        rows.append([arch, ",".join(sorted(features)) or "-", ",".join(full) or "none",
                     ",".join(partial) or "-"])
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list supported model architectures and the backends that "
                                      "can run them")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.backends_cmd import format_table

    print(format_table(models_table()))
    return 0
