"""Command-line flags generated from a dataclass's fields (EngineArgs, AsyncEngineArgs).

Each field ``name: T = field(default=X, metadata={"help": ..., "choices": (...)})`` becomes
``--name`` (underscores as dashes) whose help line shows the help text, the default and the
choices. A field without metadata still gets a flag (help: its name), so a field added without
help never breaks the command line; tests/entrypoints/test_cli_help.py asks for help on every one.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin


def _strip_optional(hint: Any) -> Any:
    """``T | None`` -> ``T``; any other hint unchanged."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _comma_list(item: type) -> Any:
    def parse(text: str) -> list[Any]:
        return [item(v.strip()) for v in text.split(",") if v.strip()]

    parse.__name__ = f"comma-separated {item.__name__}"  # argparse names it in its errors
    return parse


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def field_cli_kwargs(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """``parser.add_argument`` keywords for one field: type, default, choices, help.

    bool -> a switch (``--x``; ``--x/--no-x`` when it defaults to True); int, float, str -> that
    type; ``Literal[...]`` -> its values as choices; ``list[T]`` -> one comma-separated value (never
    ``nargs``, which would swallow a following positional argument); anything else -> str.
    """
    default = field_default(f)
    meta = f.metadata or {}
    help_text = str(meta.get("help") or f"engine argument {f.name}")
    base = _strip_optional(hint)
    choices = meta.get("choices")
    kwargs: dict[str, Any] = {"default": default, "dest": f.name}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
    else:
        if get_origin(base) is Literal:
            choices = choices or tuple(v for v in get_args(base) if v is not None)
            base = type(choices[0]) if choices else str
        if get_origin(base) in (list, tuple):
            item = (get_args(base) or (str,))[0]
            kwargs["type"] = _comma_list(item if item in (int, float, str) else str)
            kwargs["metavar"] = f.name.upper() + "[,...]"
        else:
            kwargs["type"] = base if base in (int, float, str) else str
        if choices:
            kwargs["choices"] = tuple(c for c in choices if c is not None)
            kwargs["metavar"] = "{" + ",".join(map(str, kwargs["choices"])) + "}"
    shown = [help_text.rstrip(".") + "."]
    if choices:
        shown.append(f"Choices: {_show([c for c in choices if c is not None])}.")
    if default is not None:
        shown.append(f"Default: {_show(default)}.")
    elif "default" not in help_text.lower():  # else the help says what leaving it unset does
        shown.append("Default: unset.")
    kwargs["help"] = " ".join(shown).replace("%", "%%")  # argparse %-formats help strings
    return kwargs


def add_dataclass_args(parser: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per init field of ``cls`` not in ``skip`` (see field_cli_kwargs)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), **field_cli_kwargs(f, hints[f.name]))


def dataclass_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of ``cls``'s fields that the namespace has."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.init and hasattr(args, f.name)}
