"""The request fields that constrain or edit the logits: response_format, vLLM's guided_*
extras, logit_bias and allowed_token_ids, turned into SamplingParams fields; a bad value is a
400 naming its field."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pagedllm.engine.guided import GuidedBackendUnavailable, validate_guided_params
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import SamplingRequest
from pagedllm.sampling_params import GuidedDecodingParams

_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"),
                  ("guided_choice", "choice"), ("guided_grammar", "grammar"))


def guided_constraints(req: SamplingRequest) -> list[tuple[str, dict[str, Any]]]:
    """(request field, GuidedDecodingParams keywords) for every constraint the request sets."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # checked by the protocol
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    for name, key in _GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    return found


def build_guided(param: str, kwargs: dict[str, Any], req: SamplingRequest) -> GuidedDecodingParams:
    """Validated params (the schema, regex or grammar parsed); 400 naming ``param`` if bad, 501
    naming the package when the guided-decoding backend is not installed."""
    try:
        gd = GuidedDecodingParams(**kwargs, backend=req.guided_decoding_backend,
                                  whitespace_pattern=req.guided_whitespace_pattern)
        validate_guided_params(gd)
    except GuidedBackendUnavailable as exc:
        raise guided_unavailable(exc, param) from exc
    except ValueError as exc:
        message = str(exc)
        if "GuidedDecodingParams.backend" in message:
            param = "guided_decoding_backend"
        elif "GuidedDecodingParams.whitespace_pattern" in message:
            param = "guided_whitespace_pattern"
        raise bad_request(f"{param}: {message}", param) from exc
    return gd


def guided_unavailable(exc: GuidedBackendUnavailable, param: str) -> OpenAIError:
    """501: a valid request that this server cannot run (its install lacks xgrammar)."""
    return OpenAIError(HTTPStatus.NOT_IMPLEMENTED, f"{param}: {exc}", param,
                       code="guided_decoding_unavailable")


def guided_decoding(req: SamplingRequest,
                    extra: tuple[str, dict[str, Any]] | None = None) -> GuidedDecodingParams | None:
    """The request's one guided-decoding constraint (``extra``: one implied by another field,
    e.g. tool_choice), or None; 400 when several are set or one is invalid."""
    found = guided_constraints(req) + ([extra] if extra is not None else [])
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one structured-output constraint may be set per request; got "
                          f"{names}", found[1][0])
    return build_guided(*found[0], req)


def logit_bias(req: SamplingRequest, vocab_size: int) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    bias = {int(k): v for k, v in req.logit_bias.items()}
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise bad_request(f"logit_bias: token id {bad[0]} is out of range: token ids must be in "
                          f"[0, {vocab_size - 1}]", "logit_bias")
    return bias
