"""tools / tool_choice of a chat request: which ToolMode it runs in, and for ``required`` and a
named function the guided-decoding JSON schema that makes the output a valid call."""
from __future__ import annotations

from typing import Any

from pagedllm.engine.guided import GuidedBackendUnavailable, validate_guided_params
from pagedllm.entrypoints.openai.chat_output import ToolMode
from pagedllm.entrypoints.openai.cli_args import ServerSettings
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ToolDefinition
from pagedllm.entrypoints.openai.structured import guided_unavailable
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tool_schema import schema_problem
from pagedllm.sampling_params import GuidedDecodingParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def required_schema(tools: list[ToolDefinition]) -> dict[str, Any]:
    """A non-empty JSON list of {"name": one tool's name, "parameters": its arguments}."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                          "parameters": _parameters(t)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}


def _compile_problem(schema: dict[str, Any]) -> str | None:
    """What the guided-decoding backend refuses in ``schema`` (its message's first line)."""
    try:
        validate_guided_params(GuidedDecodingParams(json=schema))
    except GuidedBackendUnavailable as exc:
        raise guided_unavailable(exc, "tool_choice") from exc
    except ValueError as exc:  # "guided_decoding.json=<the schema> is invalid: <why>"
        return str(exc).split(" is invalid: ", 1)[-1]
    return None


def check_tool_schemas(tools: list[ToolDefinition], compiled: set[str]) -> None:
    """400 naming ``tools[i].function.parameters`` for the first invalid schema; the tools named
    in ``compiled`` (those the output is constrained to) are compiled by the backend too."""
    for i, tool in enumerate(tools):
        schema = tool.function.parameters
        if schema is None:
            continue
        problem = schema_problem(schema)
        if problem is None and tool.function.name in compiled:
            problem = _compile_problem(schema)
        if problem is not None:
            param = f"tools[{i}].function.parameters"
            raise bad_request(f"{param}: invalid JSON schema for function "
                              f"{tool.function.name!r}: {problem}", param)


def tool_mode(req: ChatCompletionRequest, settings: ServerSettings
              ) -> tuple[ToolMode, tuple[str, dict[str, Any]] | None]:
    """(mode, the guided constraint it implies as (field, GuidedDecodingParams keywords))."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools and settings.enable_auto_tool_choice else "none"
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                              f"({', '.join(names)})", "tool_choice")
        check_tool_schemas(tools, {name})
        tool = tools[names.index(name)]
        return ToolMode("named", name=name), ("tool_choice", {"json": _parameters(tool)})
    check_tool_schemas(tools, set(names) if choice == "required" else set())
    if choice == "required":
        return ToolMode("required"), ("tool_choice", {"json": required_schema(tools)})
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              '--tool-call-parser to be set', "tool_choice")
        return ToolMode("auto", parser=get_tool_parser(settings.tool_call_parser)), None
    return ToolMode("none"), None


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (none when tool_choice is 'none')."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]
