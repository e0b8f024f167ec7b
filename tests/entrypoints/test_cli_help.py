"""``--help`` of every command lists every engine flag with its help text, default and choices;
``--version``. The flags come from EngineArgs' field metadata (pagedllm/engine/arg_cli.py)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedllm.entrypoints.cli import make_parser
from pagedllm.version import __version__


def _subparser(command: str):
    parser = make_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command]


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


@pytest.mark.parametrize("command, cls", [("serve", AsyncEngineArgs), ("generate", EngineArgs),
                                          ("bench", EngineArgs)])
def test_every_engine_field_has_help_default_and_choices(command: str, cls: type) -> None:
    actions = {s: a for a in _subparser(command)._actions for s in a.option_strings}
    for f in dataclasses.fields(cls):
        if f.name == "model" and command == "serve":
            continue  # the positional MODEL (and --model) of serve
        action = actions.get(_flag(f))
        assert action is not None, f"{command} has no {_flag(f)}"
        assert f.metadata.get("help"), f"EngineArgs.{f.name} has no metadata help"
        assert action.help.startswith(f.metadata["help"].rstrip(".")), action.help
        assert "default" in action.help.lower(), f"{_flag(f)} help shows no default"
        if f.metadata.get("choices"):
            shown = ", ".join(str(c) for c in f.metadata["choices"] if c is not None)
            assert f"Choices: {shown}." in action.help
            assert tuple(action.choices) == tuple(c for c in f.metadata["choices"] if c is not None)


def test_field_without_metadata_still_gets_a_flag() -> None:
    import argparse

    from pagedllm.engine.arg_cli import add_dataclass_args, dataclass_kwargs

    @dataclasses.dataclass
    class Args:
        plain: int | None = None
        names: list[str] = dataclasses.field(default_factory=list)
        on: bool = True

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Args)
    ns = parser.parse_args(["--plain", "3", "--names", "a,b", "--no-on"])
    assert dataclass_kwargs(Args, ns) == {"plain": 3, "names": ["a", "b"], "on": False}


def test_help_output_lists_every_flag_and_version() -> None:
    env = dict(os.environ, COLUMNS="200")
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--help"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for f in dataclasses.fields(EngineArgs):
        assert _flag(f) in out.stdout
    assert "Default: 16." in out.stdout and "Choices: auto, float32, float16, bfloat16." in out.stdout
    ver = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert ver.returncode == 0 and ver.stdout.strip() == __version__


def test_throughput_script_help_has_its_whole_description() -> None:
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, env=dict(os.environ, COLUMNS="300"), timeout=120)
    assert out.returncode == 0, out.stderr
    description = out.stdout.split("\n\n")[1]
    assert "(like vLLM's benchmark_throughput)" in description and "ignore_eos" in description
    assert "--output-json PATH" in out.stdout and "--plot PATH" in out.stdout


def _flags_of_every_command() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every optional flag of every ``pagedllm`` subcommand, read from the
    parser objects (nested subcommands too); help and version actions left out."""
    found: list[tuple[str, argparse.Action]] = []

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)
            elif action.option_strings and not isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)):
                found.append((prefix, action))

    walk("", make_parser())
    return found


def _renderings(value: object) -> set[str]:
    """How a help text may spell a default value."""
    if isinstance(value, (list, tuple)):
        return {", ".join(map(str, value)), ",".join(map(str, value))}
    shown = {str(value)}
    if isinstance(value, float):
        shown |= {f"{value:g}", str(int(value)) if value.is_integer() else str(value)}
    return shown


def test_every_flag_of_every_command_has_help_that_shows_its_default() -> None:
    flags = _flags_of_every_command()
    assert {c for c, _ in flags} >= {"serve", "generate", "bench", "backends"}
    missing = []
    for command, action in flags:
        flag = action.option_strings[-1]
        text = action.help or ""
        if not text or text == argparse.SUPPRESS:
            missing.append(f"{command} {flag}: no help")
        elif "default" not in text.lower():
            missing.append(f"{command} {flag}: the help shows no default: {text!r}")
        elif action.default is not None and not any(r in text
                                                    for r in _renderings(action.default)):
            missing.append(f"{command} {flag}: the help does not show the default "
                           f"{action.default!r}: {text!r}")
    assert not missing, "\n".join(missing)


def test_generate_help_shows_every_sampling_flag_with_its_default() -> None:
    from pagedllm.entrypoints.generate_cmd import SAMPLING_FLAGS

    env = dict(os.environ, COLUMNS="400")  # no wrapped help text
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--help"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines: dict[str, str] = {}  # flag -> its entry (a long flag's help is on the next line)
    flag = None
    for line in out.stdout.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            lines[flag] = line
        elif flag and line.startswith("    "):
            lines[flag] += " " + line.strip()
        else:
            flag = None
    for name, (_, default, _) in SAMPLING_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        assert f"(default: {default})" in lines[flag], lines.get(flag)
    assert "(default: False)" in lines["--ignore-eos"]
