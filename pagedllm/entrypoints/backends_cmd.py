"""`pagedllm backends`: every known backend, where it came from, and whether it can run here."""
from __future__ import annotations

import argparse


def backends_table() -> list[list[str]]:
    from pagedllm.backends.registry import discover

    rows = [["name", "source", "status", "torch device", "capabilities"]]
    for info in discover().values():
        ok, reason = info.availability()
        if info.cls is None:
            rows.append([info.name, info.source, f"unavailable: {reason}", "-", "-"])
            continue
        rows.append([info.name, info.source, "available" if ok else f"unavailable: {reason}",
                     info.cls.torch_device, info.cls.capabilities.summary()])
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list hardware backends and whether they are available")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(format_table(backends_table()))
    return 0
