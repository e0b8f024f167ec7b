"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated strictly.

Types are strict (``"5"`` is not an integer, ``true`` is not a number) and ranges are checked
here, so a bad field becomes a 400 whose ``param`` names it. Limits that depend on the server
(--max-n, --max-logprobs, the model's length and vocabulary) are checked by the serving code.
Unknown fields are ignored, as OpenAI does.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's structured-output schema."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _check_stop(value: Any) -> str | list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("stop must be a string or a list of strings")
    if any(s == "" for s in items):
        raise ValueError("stop strings must be non-empty")
    return value


class SamplingRequest(_Strict):
    """The fields shared by completions and chat completions."""

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    timeout_seconds: Seconds | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NonNegativeInt | None = None
    # vLLM's guided-decoding extras (response_format is the OpenAI way)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value not in (0, -1):
            raise ValueError("top_k must be -1 or 0 (disabled) or an integer >= 1")
        return value

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[str, float] | None:
        """OpenAI's: token-id keys (strings in JSON) to biases in [-100, 100]."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to numbers")
        for k, v in value.items():
            if not str(k).isdigit():
                raise ValueError(f"logit_bias key {k!r} is not a token id (an integer >= 0)")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias value {v!r} of token {k} must be a number in "
                                 f"[-100, 100]")
        return {str(k): float(v) for k, v in value.items()}

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None and value.type == "json_schema" and (
                value.json_schema is None or value.json_schema.json_schema is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists; none empty."""
    def is_id(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    shape = ("prompt must be a string, a list of strings, a list of token ids or a list of "
             "lists of token ids")
    if isinstance(value, str):
        if not value:
            raise ValueError("prompt is empty")
        return value
    if not isinstance(value, list):
        raise ValueError(shape)
    if not value:
        raise ValueError("prompt is an empty list")
    if all(isinstance(p, str) for p in value):
        if any(not p for p in value):
            raise ValueError("prompt contains an empty string")
        return value
    if all(is_id(t) for t in value):
        return value
    if all(isinstance(p, list) and all(is_id(t) for t in p) for p in value):
        if any(not p for p in value):
            raise ValueError("prompt contains an empty list of token ids")
        return value
    raise ValueError(shape)


class CompletionRequest(SamplingRequest):
    prompt: Any
    best_of: PositiveInt | None = None
    echo: bool | None = False
    logprobs: NonNegativeInt | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part type {part.type!r} is not supported: "
                                     "only {'type': 'text', 'text': ...} parts are")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def to_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # templates read arguments as an object (``| tojson``) where the JSON text parses
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(
                     c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(SamplingRequest):
    messages: Messages
    logprobs: bool | None = False
    top_logprobs: NonNegativeInt | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if (isinstance(value, dict) and value.get("type") == "function"
                and isinstance(value.get("function"), dict)
                and isinstance(value["function"].get("name"), str)):
            return value
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': NAME}}")



class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
