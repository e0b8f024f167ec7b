"""Results of a benchmark as JSON and as a bar chart (pagedllm vs its peers), shared by
``pagedllm bench`` and the scripts under benchmarks/ (through benchmarks/_report.py).

    add_report_args(parser)               # --output-json PATH, --plot PATH
    write_report(args, results, bars, title=..., unit="output tok/s")
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", type=Path, default=None, metavar="PATH",
                        help="write the results as JSON to PATH (default: not written)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="draw the engines' throughput side by side into PATH (.png, .svg, "
                             ".pdf; needs matplotlib: pip install matplotlib) (default: no plot)")


def check_report_args(args: argparse.Namespace) -> None:
    """Fail before the run, not after it: matplotlib present, output folders there."""
    for name in ("output_json", "plot"):
        path = getattr(args, name, None)
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--{name.replace('_', '-')} {path}: folder "
                             f"{Path(path).resolve().parent} does not exist")
    if getattr(args, "plot", None) is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib") from None


def write_json(path: Path, results: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file
    logger.info("results written to %s", path)


def plot_bars(path: Path, bars: Sequence[tuple[str, float]], title: str, unit: str) -> None:
    """One bar per engine, its value on top and its ratio to the first (pagedllm) below it."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    names = [name for name, _ in bars]
    values = [value for _, value in bars]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(bars), 4.0), dpi=120)
    colors = ["#1f77b4"] + ["#999999"] * (len(bars) - 1)
    rects = ax.bar(names, values, color=colors)
    first = values[0] if values and values[0] else None
    labels = [f"{v:,.1f}" + (f"\n{names[0]} {first / v:.2f}x" if first and i and v else "")
              for i, v in enumerate(values)]
    ax.bar_label(rects, labels=labels, padding=2, fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(values + [1.0]) * 1.25)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    logger.info("plot written to %s", path)


def write_report(args: argparse.Namespace, results: dict[str, Any],
                 bars: Sequence[tuple[str, float]], title: str, unit: str = "output tok/s"
                 ) -> None:
    """``--output-json`` and ``--plot``, each where asked for."""
    if getattr(args, "output_json", None) is not None:
        write_json(args.output_json, results)
    if getattr(args, "plot", None) is not None:
        plot_bars(args.plot, bars, title, unit)
