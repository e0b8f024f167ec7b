"""Tokenizer-free checks of a guided-decoding constraint, run when a request is added, so a bad
schema, regex or grammar fails that request at once with the field named (a 400 on the server)."""
from __future__ import annotations

import importlib.util
import json
from typing import Any

from pagedllm.sampling_params import GuidedDecodingParams


XGRAMMAR_REQUIREMENT = "xgrammar>=0.2.9"  # as setup.py's install_requires


class GuidedBackendUnavailable(ImportError):
    """The guided-decoding backend (xgrammar) is not installed or does not import: a request that
    needs it cannot run here (the server answers 501), which says nothing about the request."""


def import_xgrammar() -> Any:
    """The xgrammar module; GuidedBackendUnavailable naming the package when it does not import."""
    try:
        import xgrammar
    except ImportError as exc:
        raise GuidedBackendUnavailable(
            f"structured output (guided decoding) needs the xgrammar package, which does not "
            f"import here ({exc}); install it: pip install '{XGRAMMAR_REQUIREMENT}'") from exc
    return xgrammar


def guided_backend_problem() -> str | None:
    """Why structured output is unavailable (xgrammar not installed), or None; looks for the
    package without importing it (the server's start-up check)."""
    try:
        found = importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        found = False
    if found:
        return None
    return (f"the xgrammar package is not installed (pip install '{XGRAMMAR_REQUIREMENT}'), so "
            "structured output (response_format json_schema/json_object, guided_*, tool_choice "
            "required or named) is unavailable")


# xgrammar's character class for strings with a length bound admits raw control characters,
# which strict JSON parsers reject; it is replaced by the class of its unbounded strings
_LENIENT_CHAR = r'[^\"\\\r\n]'
_STRICT_CHAR = r'[^\0-\x1f\"\\]'


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(exc: BaseException) -> str:
    """xgrammar's errors start with a timestamp and a C++ source location; keep the message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ")[0]:
        text = text.split(": ", 1)[1]
    return text


def parse_grammar(params: GuidedDecodingParams) -> Any:
    """The constraint as an ``xgrammar.Grammar``; ValueError naming the field when it is invalid
    (GuidedBackendUnavailable when xgrammar is not installed)."""
    xgr = import_xgrammar()

    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            ebnf = str(grammar)
            if _LENIENT_CHAR in ebnf:  # strict JSON: no raw control characters in strings
                grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LENIENT_CHAR, _STRICT_CHAR))
            return grammar
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice or []))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        # json_object: any JSON object (OpenAI's meaning; xgrammar's built-in JSON grammar
        # would also admit a top-level array), written compactly
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        value = getattr(params, kind)
        shown = value if len(str(value)) <= 200 else str(value)[:200] + "..."
        raise ValueError(f"guided_decoding.{kind}={shown!r} is invalid: {_first_line(exc)}") from None


def validate_guided_params(params: GuidedDecodingParams) -> None:
    """Raises ValueError naming the field when the schema / regex / grammar cannot be parsed."""
    parse_grammar(params)
