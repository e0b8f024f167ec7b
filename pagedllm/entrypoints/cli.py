"""The ``pagedllm`` command: ``serve``, ``generate``, ``bench``, ``backends``, ``proxy`` (and
``--version``).

    pagedllm serve MODEL [--device cpu] [--port 8000] [engine flags ...]
    pagedllm generate [--model PATH] [--device D] [sampling flags] PROMPT... [--prompts-file F]
    pagedllm bench [--model PATH] [--peer hf] [--output-json F] [--plot F.png] [engine flags ...]
    pagedllm backends
    pagedllm proxy --prefill URL --decode URL [--port 8000]

Each subcommand adds its own subparser and sets ``func``, a function of the parsed args that
returns the exit status. Engine imports happen inside ``func`` so ``pagedllm --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from pagedllm.entrypoints.omp_env import set_spin_default
from pagedllm.logger import configure_logging, one_line

logger = logging.getLogger("pagedllm.cli")


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
    _add_module("pagedllm.entrypoints.proxy"),
]


def make_parser() -> argparse.ArgumentParser:
    from pagedllm.version import __version__

    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm command line")
    parser.add_argument("-v", "--version", action="version", version=__version__)  # as vLLM's
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The subcommand's exit status. What it raises is one ERROR line, not a traceback: exit 2 for
    a bad argument value (ValueError: the message names the argument), 1 for a runtime failure
    (RuntimeError, OSError: a backend that is not available here, a failed load); the traceback
    is logged at DEBUG level. 130 on Ctrl-C."""
    try:
        return func(args)
    except ValueError as exc:
        logger.error("%s", one_line(exc))
        logger.debug("traceback", exc_info=True)
        return 2
    except (RuntimeError, OSError, ImportError) as exc:
        logger.error("%s", one_line(exc))
        logger.debug("traceback", exc_info=True)
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130


def main(argv: list[str] | None = None) -> None:
    """Exit status: 0 success, 1 runtime error, 2 usage error (argparse's, or a bad value)."""
    set_spin_default()  # before anything imports torch (omp_env.py)
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    configure_logging()
    sys.exit(run_command(args.func, args))


if __name__ == "__main__":
    main()
