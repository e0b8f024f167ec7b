"""Flags of ``pagedllm serve`` / ``python -m pagedllm.entrypoints.openai.api_server``.

The server's own flags, plus every AsyncEngineArgs field as a kebab-case flag. The model is the
positional MODEL or ``--model`` (either; both must agree).
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm import envs
from pagedllm.engine.arg_utils import DEMO_MODEL, AsyncEngineArgs, EngineArgs
from pagedllm.entrypoints.openai.lora_modules import parse_lora_module

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass
class ServerSettings:
    """Server-level knobs (the engine's are in EngineArgs)."""

    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_n: int = 16
    max_logprobs: int = 20
    max_body_bytes: int = 4 * MiB
    shutdown_timeout: float = 30.0
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # LoRA (serving_lora.py): --enable-lora, --lora-modules, runtime load/unload allowed
    enable_lora: bool = False
    lora_modules: list[Any] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"a local Hugging Face checkpoint folder (default {DEMO_MODEL!r})")
    parser.add_argument("--model", default=None,
                        help="the same as the positional MODEL (default: MODEL)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    server.add_argument("--api-key", default=envs.PAGEDLLM_API_KEY,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $PAGEDLLM_API_KEY)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported (default: MODEL). "
                             "Give MODEL before this flag (or use --model): a MODEL after it is "
                             "taken as MODEL when it is a path")
    server.add_argument("--max-n", type=int, default=16,
                        help="largest n / best_of per request (default 16)")
    server.add_argument("--max-logprobs", type=int, default=20,
                        help="largest logprobs / top_logprobs per request (default 20)")
    server.add_argument("--max-request-body-bytes", type=int, default=4 * MiB,
                        help="larger request bodies get 413 (default 4194304: 4 MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish (default 30)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (file path or inline) overriding the "
                             "tokenizer's (default: the tokenizer's)")
    add_structured_output_args(server)
    add_lora_args(server)
    server.add_argument("--disable-frontend-multiprocessing", action="store_true",
                        help="run the engine in the server's process (a thread) instead of its "
                             "own process (default: False)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default info)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access log line per HTTP request (default: False)")
    add_engine_args(parser.add_argument_group("engine"), AsyncEngineArgs, skip=("model",))
    return parser


def add_structured_output_args(group: Any) -> None:
    """Tool calling and reasoning output (vLLM's flags)."""
    from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide when to call tools (tool_choice 'auto', the "
                            "default when a request has tools); needs --tool-call-parser "
                            "(default: False)")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls appear in this model's output (default: none)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="return the <think>...</think> part of the output as "
                            "reasoning_content (default: none, all of it is content)")


def add_lora_args(group: Any) -> None:
    """LoRA adapters served by name (vLLM's flags; the engine's are --enable-lora etc.)."""
    # parsed by validate_args (parse_lora_module), after a MODEL the list took is given back
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) served by name: the OpenAI model field "
                            "selects one; name=path or JSON with name, path, base_model_name; "
                            "needs --enable-lora (default: none)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING,
                       help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(default: $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING, else False)")


def add_engine_args(parser: Any, cls: type[EngineArgs] = AsyncEngineArgs,
                    skip: tuple[str, ...] = ()) -> None:
    """Every field of ``cls`` as a flag, with its help, default and choices."""
    cls.add_cli_args(parser, skip=skip)


def _is_path(value: str) -> bool:
    """A local folder, or spelled as a path (not a hub-style ``org/name`` served name)."""
    return (os.path.isdir(os.path.expanduser(value))
            or value.startswith(("/", "./", "../", "~")))


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    names = args.served_model_name
    if not args.model_tag and not args.model and names and len(names) > 1 and _is_path(names[-1]):
        # `serve --served-model-name NAME /path/ckpt`: nargs="+" took the positional MODEL too
        args.model_tag = names.pop()
        logger.info("MODEL %r came after --served-model-name; serving it as %s", args.model_tag,
                    names)
    mods = getattr(args, "lora_modules", None)
    if (not args.model_tag and not args.model and mods and len(mods) > 1
            and _is_path(mods[-1]) and "=" not in mods[-1]):
        # `serve --lora-modules a=/x /path/ckpt`: nargs="+" took the positional MODEL too
        args.model_tag = mods.pop()
        logger.info("MODEL %r came after --lora-modules", args.model_tag)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
    return args.model_tag or args.model or DEMO_MODEL


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill ``args.model`` and check the server flags (the engine checks its own)."""
    args.model = resolve_model(args, parser)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is invalid: must be in [0, 65535]")
    for flag in ("max_n", "max_request_body_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_logprobs < 0:
        parser.error(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_key == "":
        parser.error("--api-key is empty; give a key or leave the flag out")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    try:
        args.lora_modules = [parse_lora_module(v) if isinstance(v, str) else v
                             for v in args.lora_modules or []]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (one of hermes, "
                     "llama3_json, mistral)")


def load_chat_template(value: str | None) -> str | None:
    """A file path's contents, or the value itself as an inline template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        served_model_names=list(args.served_model_name or [args.model]), model_path=args.model,
        api_key=args.api_key, max_n=args.max_n, max_logprobs=args.max_logprobs,
        max_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout,
        chat_template=load_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        enable_lora=bool(getattr(args, "enable_lora", False)),
        lora_modules=list(getattr(args, "lora_modules", None) or []),
        allow_runtime_lora_updating=bool(getattr(args, "allow_runtime_lora_updating", False)))
