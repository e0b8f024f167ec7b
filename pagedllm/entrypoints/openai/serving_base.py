"""What the completion and chat handlers share: model names, prompt checks, sampling params,
adding requests to the engine, and waiting for results while watching for a client disconnect."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import AsyncEngineBase, AsyncStream
from pagedllm.entrypoints.openai.cli_args import ServerSettings
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, from_value_error
from pagedllm.entrypoints.openai.logprobs import TokenTexts
from pagedllm.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from pagedllm.entrypoints.openai.sse import SSEResponse
from pagedllm.entrypoints.openai.structured import guided_decoding, logit_bias
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_JSON = json.JSONEncoder(separators=(",", ":"))


def sse(data: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(data)}\n\n"


class ChunkFormat:
    """SSE events of one streamed response: the head (id, object, created, model) is encoded once,
    and each event adds only its one choice (the per-token cost of a stream)."""

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = f"data: {_JSON.encode(head)[:-1]},\"choices\":["

    def choice(self, choice: dict[str, Any]) -> str:
        return f"{self._prefix}{_JSON.encode(choice)}]}}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_event(exc: BaseException) -> str:
    if isinstance(exc, OpenAIError):
        return sse(exc.body())
    logger.error("stream failed: %r", exc)
    return sse(OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed: {exc}").body())


def prompt_logprobs_json(texts: TokenTexts, out: RequestOutput) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}}; rank orders the entries of a position (1 = most likely)."""
    result: list[dict[str, Any] | None] = []
    for entry in out.prompt_logprobs or []:
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
        result.append({str(t): {"logprob": max(lp, -9999.0), "rank": r,
                                "decoded_token": texts(t)}
                       for r, (t, lp) in enumerate(ranked, start=1)})
    return result


class ServingContext:
    def __init__(self, engine: AsyncEngineBase, settings: ServerSettings, tokenizer: Any) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = tokenizer
        self.max_model_len: int = engine.model_info.max_model_len
        self.vocab_size: int = engine.model_info.vocab_size
        self.token_texts = TokenTexts(tokenizer)
        self.lora: Any = None  # serving_lora.OpenAIServingLoRA: adapters served by name

    def lora_request(self, model: str | None) -> Any:
        """The LoRA adapter the request's ``model`` names, None for the base model."""
        return self.lora.request_for(model) if self.lora is not None else None

    # --- request fields ------------------------------------------------------------------
    def check_model(self, requested: str | None) -> str:
        """The served name to answer with; 404 for a name this server does not serve."""
        if requested is None or requested in self.settings.served_model_names:
            return self.settings.model_name
        if self.lora_request(requested) is not None:  # a LoRA adapter answers as itself
            return requested
        served = [*self.settings.served_model_names, *(self.lora.adapters if self.lora else ())]
        raise OpenAIError(HTTPStatus.NOT_FOUND,
                          f"The model `{requested}` does not exist. This server serves "
                          f"{', '.join(repr(n) for n in served)}.",
                          param="model", code="model_not_found")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for t in token_ids:
            if t < 0 or t >= self.vocab_size:
                raise bad_request(f"token id {t} in {param} is out of range: token ids must be in "
                                  f"[0, {self.vocab_size - 1}]", param)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # verbose=False: no transformers warning for a text longer than the tokenizer's
        # model_max_length; resolve_max_tokens answers such a prompt with a 400
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens,
                                   verbose=False).input_ids)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, through the tokenizer's (or --chat-template) template."""
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                              "true", "continue_final_message")
        template = chat_template or self.settings.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; start the server "
                              "with --chat-template or use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.to_template() for m in messages], tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=template,
                tools=tools, **(kwargs or {}))
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
            raise bad_request(f"the chat template failed on these messages: {exc}",
                              "messages") from exc
        if not isinstance(text, str):
            raise bad_request("the chat template did not render to text", "messages")
        return text

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, default: int | None,
                           prompt_param: str, max_param: str = "max_tokens") -> int:
        """Check prompt + completion against max_model_len and the KV cache; the budget to use."""
        stats = self.engine.get_stats()
        capacity = min(self.max_model_len, stats.num_blocks * stats.block_size)
        room = capacity - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {capacity} tokens, but the "
                f"{prompt_param} has {prompt_len} tokens, which leaves no room for a completion. "
                f"Please shorten the {prompt_param}.", prompt_param, "context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if prompt_len + requested > capacity:
            raise bad_request(
                f"This model's maximum context length is {capacity} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
                f"{requested} in the completion). Please reduce the length of the "
                f"{prompt_param} or {max_param}.", max_param, "context_length_exceeded")
        return requested

    def check_limits(self, n: int, best_of: int | None, logprobs: int | None,
                     logprobs_param: str = "logprobs") -> None:
        s = self.settings
        if n > s.max_n:
            raise bad_request(f"n={n} is too large: this server allows n <= {s.max_n} (--max-n)", "n")
        if best_of is not None and best_of > s.max_n:
            raise bad_request(f"best_of={best_of} is too large: this server allows best_of <= "
                              f"{s.max_n} (--max-n)", "best_of")
        if logprobs is not None:
            limit = min(s.max_logprobs, self.vocab_size)
            if logprobs > limit:
                raise bad_request(f"{logprobs_param}={logprobs} is too large: this server allows "
                                  f"at most {limit} (--max-logprobs)", logprobs_param)

    def sampling_params(self, req: SamplingRequest, max_tokens: int, n: int,
                        best_of: int | None = None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        guided: GuidedDecodingParams | None = None) -> SamplingParams:
        """``guided``: the request's constraint when the caller derived it (tools); else it
        comes from response_format / guided_*."""
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.allowed_token_ids is not None:
            if not req.allowed_token_ids:
                raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
        if prompt_logprobs is None:
            prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is not None:
            self.check_limits(1, None, prompt_logprobs, "prompt_logprobs")
        if guided is None:
            guided = guided_decoding(req)

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            return SamplingParams(
                n=n, best_of=best_of, temperature=pick(req.temperature, 1.0),
                top_p=pick(req.top_p, 1.0), top_k=req.top_k if req.top_k not in (None, 0) else -1,
                min_p=pick(req.min_p, 0.0), presence_penalty=pick(req.presence_penalty, 0.0),
                frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0), seed=req.seed,
                stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                ignore_eos=bool(req.ignore_eos), max_tokens=max_tokens,
                min_tokens=pick(req.min_tokens, 0), logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=pick(req.skip_special_tokens, True),
                timeout_seconds=req.timeout_seconds, guided_decoding=guided,
                logit_bias=logit_bias(req, self.vocab_size),
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    # --- running requests ----------------------------------------------------------------
    async def add_requests(self, request_id: str, prompts: list[Prompt],
                           params: list[SamplingParams], final_only: bool,
                           prompt_param: str = "prompt",
                           lora_request: Any = None) -> list[AsyncStream]:
        """One engine request per prompt (``{request_id}-{i}`` when batched); all or none.
        Streamed requests run as RequestOutputKind.DELTA (each output holds what is new),
        the others as FINAL_ONLY."""
        streams: list[AsyncStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if not final_only:
                    p = dataclasses.replace(p, output_kind=RequestOutputKind.DELTA)
                streams.append(await self.engine.add_request(
                    rid, {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}, p,
                    final_only=final_only, lora_request=lora_request))
        except ValueError as exc:
            abort_all(streams)
            raise from_value_error(exc, prompt_param) from exc
        except BaseException:
            abort_all(streams)
            raise
        return streams

    async def respond(self, streams: list[AsyncStream], raw_request: Request,
                      events: AsyncIterator[str] | None,
                      make_body: Callable[[list[RequestOutput]], dict[str, Any]]) -> Response:
        """Server-sent ``events`` when streaming (None: not streaming), else the JSON of
        ``make_body(final outputs)``; either way the requests are aborted if the client leaves."""
        if events is not None:
            return SSEResponse(events, on_close=partial(abort_all, streams))
        try:
            finals = await self.wait_final(streams, raw_request)
        except ValueError as exc:  # the engine refused the request after accepting it
            raise bad_request(str(exc)) from exc
        finally:
            abort_all(streams)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        return JSONResponse(make_body(finals))

    async def wait_final(self, streams: list[AsyncStream], raw_request: Request
                         ) -> list[RequestOutput] | None:
        """The final output of every stream, or None if the client disconnected first."""
        async def consume() -> list[RequestOutput]:
            finals: list[Any] = [None] * len(streams)
            async for i, out in merge_streams(streams):
                finals[i] = out
            return finals

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        return None


def abort_all(streams: list[AsyncStream]) -> None:
    for stream in streams:
        stream.abort()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_END = object()


async def merge_streams(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(index, output)`` from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
