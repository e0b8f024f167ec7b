"""POST /v1/completions: one engine request per prompt, ``n`` choices each, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.logprobs import CompletionLogprobs
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_base import (SSE_DONE, ChunkFormat, Prompt, ServingContext,
                                                      error_event, merge_streams,
                                                      prompt_logprobs_json,
                                                      random_id, sse, usage)
from pagedllm.engine.async_engine import AsyncStream
from pagedllm.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        prompts = self._prompts(req)
        n = req.n or 1
        ctx.check_limits(n, req.best_of, req.logprobs)
        if req.stream and req.best_of is not None and req.best_of != n:
            raise bad_request(f"best_of={req.best_of} with n={n} cannot be streamed (the best n "
                              "are known only at the end); set stream=false or best_of=n",
                              "best_of")
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = [ctx.sampling_params(
            req, ctx.resolve_max_tokens(len(p.token_ids), req.max_tokens, DEFAULT_MAX_TOKENS,
                                        "prompt"),
            n, req.best_of, req.logprobs, prompt_logprobs) for p in prompts]
        request_id, created = random_id("cmpl"), int(time.time())
        streams = await ctx.add_requests(request_id, prompts, params, final_only=not req.stream,
                                         lora_request=ctx.lora_request(req.model))
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        events = self._stream(req, head, prompts, streams, n) if req.stream else None
        return await ctx.respond(streams, raw_request, events,
                                 lambda finals: self._response(req, head, prompts, finals, n))

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        ctx, value = self.ctx, req.prompt
        add_special = req.add_special_tokens is not False
        if isinstance(value, str):
            value = [value]
        elif value and isinstance(value[0], int):
            value = [value]
        prompts = []
        for item in value:
            if isinstance(item, str):
                ids = ctx.tokenize(item, add_special)
                if not ids:
                    raise bad_request(f"prompt {item[:40]!r} tokenizes to no tokens", "prompt")
                prompts.append(Prompt(item, ids))
            else:
                ctx.check_token_ids(item, "prompt")
                prompts.append(Prompt(None, list(item)))
        return prompts

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.ctx.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _response(self, req: CompletionRequest, head: dict[str, Any], prompts: list[Prompt],
                  finals: list[RequestOutput], n: int) -> dict[str, Any]:
        choices = []
        num_prompt = num_completion = 0
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            num_prompt += len(out.prompt_token_ids)
            echo = self._prompt_text(prompt) if req.echo else ""
            for c in out.outputs:
                num_completion += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    fmt = CompletionLogprobs(self.ctx.token_texts, req.logprobs)
                    if req.echo:
                        ids = out.prompt_token_ids + c.token_ids
                        entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                        logprobs = fmt.format(ids, entries + list(c.logprobs or []))
                    else:
                        logprobs = fmt.format(c.token_ids, c.logprobs or [])
                choices.append({"index": i * n + c.index, "text": echo + c.text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
                if req.prompt_logprobs is not None:  # vLLM's: per choice
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_json(self.ctx.token_texts,
                                                                          out)
        choices.sort(key=lambda c: c["index"])
        return {**head, "choices": choices, "usage": usage(num_prompt, num_completion),
                "system_fingerprint": None}

    async def _stream(self, req: CompletionRequest, head: dict[str, Any], prompts: list[Prompt],
                      streams: list[AsyncStream], n: int) -> AsyncIterator[str]:
        """The streams' outputs are deltas (RequestOutputKind.DELTA): each chunk is formatted
        from what is new, so a request costs O(new tokens) per step."""
        total = len(prompts) * n
        started, done = [False] * total, [False] * total
        fmts = [CompletionLogprobs(self.ctx.token_texts, req.logprobs)
                if req.logprobs is not None else None for _ in range(total)]
        num_prompt = num_completion = 0
        fmt_chunk = ChunkFormat(head)
        try:
            async for i, out in merge_streams(streams):
                parts = []
                for c in out.outputs:
                    idx = i * n + c.index
                    if done[idx]:
                        continue
                    text, ids = c.text, c.token_ids
                    num_completion += len(ids)
                    if not text and not ids and c.finish_reason is None:
                        continue
                    fmt, logprobs = fmts[idx], None
                    if not started[idx] and req.echo:  # the prompt comes first
                        text = self._prompt_text(prompts[i]) + text
                        if fmt is not None:
                            prompt_ids = prompts[i].token_ids
                            entries = out.prompt_logprobs or [None] * len(prompt_ids)
                            logprobs = fmt.format(prompt_ids, list(entries))
                    if fmt is not None:
                        new = fmt.format(ids, c.logprobs or [])
                        logprobs = new if logprobs is None else {
                            k: logprobs[k] + new[k] for k in new}
                    started[idx] = True
                    if c.finish_reason is not None:
                        done[idx] = True
                    parts.append(fmt_chunk.choice({
                        "index": idx, "text": text, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}))
                if out.finished:
                    num_prompt += len(prompts[i].token_ids)
                if parts:
                    yield "".join(parts)
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(num_prompt, num_completion)})
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE
