"""The ``pagedllm`` command: ``serve``, ``generate``, ``backends`` (and ``bench``).

    pagedllm serve MODEL [--device cpu] [--port 8000] [engine flags ...]
    pagedllm generate [--model PATH] [--device D] [sampling flags] PROMPT... [--prompts-file F]
    pagedllm backends

Each subcommand adds its own subparser and sets ``func``, a function of the parsed args that
returns the exit status. Engine imports happen inside ``func`` so ``pagedllm --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from pagedllm.logger import configure_logging


# --- serve ---------------------------------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                            description="Serve a model over the OpenAI API (/v1/completions, "
                                        "/v1/chat/completions, /v1/models, /metrics, ...).")
    make_arg_parser(parser)
    parser.set_defaults(func=_run_serve, parser=parser)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.cli_args import validate_args

    validate_args(args, args.parser)
    return run_server(args)


# --- registry ------------------------------------------------------------------------------
def _add_module(module: str) -> Callable[[argparse._SubParsersAction], None]:
    """A subcommand whose module has ``add_parser(subparsers)`` setting ``func=run``."""
    def add(sub: argparse._SubParsersAction) -> None:
        importlib.import_module(module).add_parser(sub)

    return add


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_serve,
    _add_module("pagedllm.entrypoints.generate_cmd"),
    _add_module("pagedllm.entrypoints.backends_cmd"),
    _add_module("pagedllm.entrypoints.models_cmd"),
    _add_module("pagedllm.entrypoints.bench_cmd"),
]


def make_parser() -> argparse.ArgumentParser:
    from pagedllm.version import __version__

    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm command line")
    parser.add_argument("-v", "--version", action="version", version=__version__)  # as vLLM's
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    configure_logging()
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
