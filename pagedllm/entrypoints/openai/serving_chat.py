"""POST /v1/chat/completions: the chat template renders the messages (and tools), then one
engine request; tool calls and reasoning are split out of the output (chat_output.py)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import AsyncStream
from pagedllm.entrypoints.openai.chat_output import ChoiceStream, ToolMode, final_message
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_base import (SSE_DONE, ChunkFormat, Prompt, ServingContext,
                                                      error_event, prompt_logprobs_json,
                                                      random_id, sse, usage)
from pagedllm.entrypoints.openai.structured import guided_decoding
from pagedllm.entrypoints.openai.tools import template_tools, tool_mode
from pagedllm.outputs import RequestOutput


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        n = req.n or 1
        ctx.check_limits(n, None, top_k, "top_logprobs")
        mode, tool_constraint = tool_mode(req, ctx.settings)
        guided = guided_decoding(req, tool_constraint)
        text = ctx.render_chat(req.messages, req.add_generation_prompt is not False,
                               bool(req.continue_final_message), req.chat_template,
                               req.chat_template_kwargs, tools=template_tools(req))
        ids = ctx.tokenize(text, add_special_tokens=False)  # the template adds any BOS itself
        if not ids:
            raise bad_request("the messages render to an empty prompt", "messages")
        if req.max_completion_tokens is not None:
            requested, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, max_param = req.max_tokens, "max_tokens"
        max_tokens = ctx.resolve_max_tokens(len(ids), requested, None, "messages", max_param)
        params = ctx.sampling_params(req, max_tokens, n, logprobs=top_k, guided=guided)
        request_id, created = random_id("chatcmpl"), int(time.time())
        streams = await ctx.add_requests(request_id, [Prompt(text, ids)], [params],
                                         final_only=not req.stream, prompt_param="messages",
                                         lora_request=ctx.lora_request(req.model))
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": model}
        reasoning = ctx.settings.reasoning_parser is not None
        events = (self._stream(req, {**head, "object": "chat.completion.chunk"}, streams[0], n,
                               top_k, mode, reasoning, len(ids)) if req.stream else None)
        return await ctx.respond(streams, raw_request, events, lambda finals: self._response(
            req, head, finals[0], top_k, mode, reasoning))

    def _response(self, req: ChatCompletionRequest, head: dict[str, Any], out: RequestOutput,
                  top_k: int | None, mode: ToolMode, reasoning: bool) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            logprobs = None
            if top_k is not None:
                logprobs = chat_logprobs(self.ctx.token_texts, c.token_ids, c.logprobs or [], top_k)
            message, finish = final_message(c.text, mode, reasoning, c.finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        completion = sum(len(c.token_ids) for c in out.outputs)
        body = {**head, "choices": choices,
                "usage": usage(len(out.prompt_token_ids), completion), "system_fingerprint": None}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(self.ctx.token_texts, out)
        return body

    async def _stream(self, req: ChatCompletionRequest, head: dict[str, Any], stream: AsyncStream,
                      n: int, top_k: int | None, mode: ToolMode, reasoning: bool, num_prompt: int
                      ) -> AsyncIterator[str]:
        """The stream's outputs are deltas (RequestOutputKind.DELTA). Plain text goes out as it
        comes, O(new tokens) per step; a reasoning parser or a tool-call mode reads the text so
        far (kept here), as its parser needs the whole of it."""
        done = [False] * n
        plain = not reasoning and (mode.kind == "none"
                                   or (mode.kind == "auto" and mode.parser is None))
        texts = [""] * n  # the text so far, where a parser needs it
        choice_streams = [ChoiceStream(mode, reasoning) for _ in range(n)]
        num_completion = 0
        fmt_chunk = ChunkFormat(head)
        try:
            yield "".join(fmt_chunk.choice({
                "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}) for i in range(n))
            async for out in stream:
                parts = []
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    ids = c.token_ids
                    num_completion += len(ids)
                    finished = c.finish_reason is not None
                    if plain:
                        delta, called = ({"content": c.text} if c.text else {}), False
                    else:
                        texts[i] += c.text
                        delta, called = choice_streams[i].delta(texts[i], finished)
                    if not delta and not ids and not finished:
                        continue
                    logprobs = None
                    if top_k is not None:
                        logprobs = chat_logprobs(self.ctx.token_texts, ids, c.logprobs or [], top_k)
                    finish = c.finish_reason
                    if finished:
                        done[i] = True
                        if called and finish == "stop":
                            finish = "tool_calls"
                    parts.append(fmt_chunk.choice({
                        "index": i, "delta": delta or {"content": ""},
                        "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": c.stop_reason}))
                if parts:
                    yield "".join(parts)
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(num_prompt, num_completion)})
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE
