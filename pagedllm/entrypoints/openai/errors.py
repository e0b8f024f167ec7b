"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""
from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          500: "server_error", 503: "server_error"}
_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
          413: "request_too_large", 500: "internal_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """An error to return to the client; ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code or _CODES.get(self.status)
        self.type = type_ or _TYPES.get(self.status, "invalid_request_error" if self.status < 500
                                        else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param, code)


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)=")


def from_value_error(exc: ValueError, default_param: str | None = None) -> OpenAIError:
    """A ValueError from SamplingParams / the engine's prompt checks, as a 400 naming the field."""
    message = str(exc)
    match = _SAMPLING_FIELD.search(message)
    param = match.group(1) if match else default_param
    return bad_request(message.replace("SamplingParams.", ""), param)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """pydantic/FastAPI's 422 as the OpenAI 400, ``param`` = the top-level body field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "),
                           code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return bad_request("the request body must be a JSON object (send it with "
                           "'Content-Type: application/json')", code="invalid_type")
    param = loc[0]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    parts = [f"{'.'.join(loc)}: {message}"]
    if "input" in first and first.get("type") != "missing":
        shown = repr(first["input"])
        parts.append(f"(got {shown[:80]})")
    return bad_request(" ".join(parts), param,
                       code="invalid_type" if str(first.get("type", "")).endswith("_type")
                       else "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="engine_dead").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.scope.get("path"))
        return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"internal server error: {type(exc).__name__}").response()
