"""The OpenAI-compatible server: FastAPI app, routes, and ``main``.

    python -m pagedllm.entrypoints.openai.api_server MODEL [--device cpu] [--port 8000] ...
    pagedllm serve MODEL ...                                  (the same flags)
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.engine.arg_utils import AsyncEngineArgs
from pagedllm.engine.async_engine import AsyncEngineBase, AsyncLLMEngine
from pagedllm.engine.guided import guided_backend_problem
from pagedllm.entrypoints.openai.cli_args import (ServerSettings, make_arg_parser, server_settings,
                                                  validate_args)
from pagedllm.entrypoints.openai.errors import OpenAIError, install_error_handlers
from pagedllm.entrypoints.openai.launcher import serve_http
from pagedllm.entrypoints.openai.lifecycle import (child_pids, kill_process_tree,
                                                   skip_teardown_collections)
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.middleware import (ApiKeyAuth, BodySizeLimit, DrainGuard,
                                                    ServerState)
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest)
from pagedllm.entrypoints.openai.serving_base import ServingContext
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import (LoadLoRAAdapterRequest, OpenAIServingLoRA,
                                                      UnloadLoRAAdapterRequest)
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.logger import configure_logging, one_line
from pagedllm.version import __version__

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngineBase, settings: ServerSettings,
              state: ServerState | None = None) -> FastAPI:
    """The ASGI app over a built engine. Its lifespan starts the engine loop and shuts it down."""
    state = state or ServerState()

    lora = OpenAIServingLoRA(engine, settings.model_name, settings.enable_lora,
                             settings.allow_runtime_lora_updating, settings.lora_modules)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start_background_loop()
        await lora.load_static()  # --lora-modules (a bad one stops the start-up, named)
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    ctx = ServingContext(engine, settings, engine.tokenizer)
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    tokenization = OpenAIServingTokenization(ctx)
    ctx.lora = lora
    metrics = ServerMetrics(settings.model_name)
    engine.add_step_listener(metrics.on_step)
    metrics.on_step(engine.get_stats(), [])
    created = int(time.time())
    app.state.engine, app.state.settings, app.state.server_state = engine, settings, state
    app.state.metrics = metrics

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"unhealthy: {exc}",
                               code="engine_dead").response()
        return Response(status_code=HTTPStatus.OK)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """The same answer as /health (vLLM's route for SageMaker-style health checks)."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
                "root": settings.model_path, "parent": None, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in settings.served_model_names]
                + lora.model_cards(model_card)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)  # 404 naming the id and the served names
        return next((c for c in lora.model_cards(model_card) if c["id"] == model_id),
                    model_card(model_id))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        return Response(await lora.load(request), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        return Response(await lora.unload(request), media_type="text/plain")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.detokenize(request))

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    # the last added is the outermost
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key)
    app.add_middleware(DrainGuard, state=state)
    return app


def build_engine(engine_args: AsyncEngineArgs, own_process: bool = True) -> AsyncEngineBase:
    """The engine in its own process (default: no GIL shared with the HTTP loop), or in this one."""
    if own_process:
        from pagedllm.entrypoints.openai.engine_client import MPEngineClient

        return MPEngineClient.from_engine_args(engine_args)
    return AsyncLLMEngine.from_engine_args(engine_args)


def kill_engine(engine: AsyncEngineBase) -> None:
    """Stop the engine at once: its process (and workers), or this process's own workers."""
    from pagedllm.entrypoints.openai.engine_client import MPEngineClient

    if isinstance(engine, MPEngineClient):
        engine.kill()
        return
    for child in child_pids(os.getpid()):  # an in-process engine's executor workers
        kill_process_tree(child)


def run_server(args: argparse.Namespace) -> int:
    """Build the engine (loads the model), then serve until SIGTERM or SIGINT; the exit status:
    0 after a drain, 2 for a bad argument, 1 when the server cannot start (launcher.py has the
    codes of a second signal)."""
    configure_logging()
    try:
        settings = server_settings(args)
        engine = build_engine(AsyncEngineArgs.from_cli_args(args),
                              not args.disable_frontend_multiprocessing)
    except ValueError as exc:
        logger.error("cannot start the server: %s", one_line(exc))
        return 2
    except (RuntimeError, OSError) as exc:
        logger.error("cannot start the server: %s", one_line(exc))
        return 1
    problem = guided_backend_problem()
    if problem:  # those requests get 501 naming the package (structured.py)
        logger.warning("%s", problem)
    state = ServerState()
    app = build_app(engine, settings, state)
    logger.info("serving %s as %s on http://%s:%d%s", args.model, settings.served_model_names,
                args.host, args.port, " (API key required)" if settings.api_key else "")
    try:
        asyncio.run(serve_http(app, state, args.host, args.port, settings.shutdown_timeout,
                               engine.fail_all_requests, partial(kill_engine, engine),
                               args.uvicorn_log_level, not args.disable_uvicorn_access_log))
    finally:  # a no-op after a clean shutdown; never leave the engine process behind
        getattr(engine, "kill", lambda: None)()
    skip_teardown_collections()  # the process exits next: seconds saved (lifecycle.py)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser(argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="OpenAI-compatible server for pagedllm."))
    args = parser.parse_args(argv)
    validate_args(args, parser)
    sys.exit(run_server(args))


if __name__ == "__main__":
    main()
