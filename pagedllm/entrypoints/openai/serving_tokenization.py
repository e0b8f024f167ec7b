"""POST /tokenize and /detokenize (vLLM's shapes)."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.serving_base import ServingContext


class OpenAIServingTokenization:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """``{"prompt"}`` or ``{"messages"}`` -> ``{"tokens", "count", "max_model_len"}``."""
        ctx = self.ctx
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages is empty", "messages")
            text = ctx.render_chat(req.messages, req.add_generation_prompt is not False,
                                   bool(req.continue_final_message), req.chat_template)
            add_special = bool(req.add_special_tokens)  # the template adds any BOS itself
        else:
            text = req.prompt  # type: ignore[assignment]
            add_special = req.add_special_tokens is not False
        tokens = ctx.tokenize(text, add_special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """``{"tokens"}`` -> ``{"prompt"}``."""
        self.ctx.check_model(req.model)
        self.ctx.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.ctx.tokenizer.decode(req.tokens)}
