"""``--output-json PATH`` and ``--plot out.png`` for the scripts in this folder: the same code as
``pagedllm bench`` (pagedllm/entrypoints/bench_report.py), so every benchmark writes the same
JSON layout and the same chart of pagedllm against its peers.

    from _report import add_report_args, check_report_args, write_report
    add_report_args(parser)          # after parse_args: check_report_args(args)
    write_report(args, summary, [("pagedllm", 612.0), ("vllm", 575.5)], title="...")
"""
from __future__ import annotations

from pagedllm.entrypoints.bench_report import (add_report_args, check_report_args, plot_bars,
                                               write_json, write_report)

__all__ = ["add_report_args", "check_report_args", "plot_bars", "write_json", "write_report"]
