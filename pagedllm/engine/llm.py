"""The offline API: ``LLM(model).generate(prompts, sampling_params)``."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.gc_freeze import frozen_gc
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Batched offline generation over a local Hugging Face checkpoint."""

    def __init__(self, model: str, tokenizer: str | None = None, device: str = "auto",
                 dtype: str = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 num_gpu_blocks_override: int | None = None, kv_cache_space_gib: float | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = False,
                 enable_chunked_prefill: bool = False, swap_space: float = 4,
                 preemption_mode: str | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 enforce_eager: bool = False, **kwargs: Any) -> None:
        args = EngineArgs(
            model=model, tokenizer=tokenizer, device=device, dtype=dtype, block_size=block_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_gpu_blocks_override=num_gpu_blocks_override, kv_cache_space_gib=kv_cache_space_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, swap_space=swap_space,
            preemption_mode=preemption_mode, seed=seed, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def shutdown(self) -> None:
        """Release the engine's workers, weights and KV cache now (``del llm`` and
        ``gc.collect()`` do the same); idempotent. The object cannot generate afterwards."""
        self._shut_down = True
        self.llm_engine.shutdown()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: a
        LoRARequest for every prompt, or a list of one (or None) per prompt (enable_lora=True).
        During the call Python's cyclic garbage collector runs no full collection
        (engine/gc_freeze.py)."""
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [{"prompt_token_ids": list(prompts)}]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} "
                                 "prompts; pass one or a list of the same length")
        # offline: only each request's last output is used, so the engine builds no others
        # (one copy per distinct params object; add_request copies each request's again)
        final: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in final:
                final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final[id(p)] for p in params]
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ValueError(f"lora_request has {len(lora_request)} entries for "
                                 f"{len(prompts)} prompts; pass one or a list of the same length")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        ids = []
        with frozen_gc():  # no full collection over the process's objects mid-run
            try:
                for prompt, p, lora in zip(prompts, params, loras):
                    rid = str(next(self._counter))
                    self.llm_engine.add_request(rid, prompt, p, lora_request=lora)
                    ids.append(rid)
            except Exception:
                self.llm_engine.abort_request(ids)
                while self.llm_engine.has_unfinished_requests():
                    self.llm_engine.step()
                raise
            outputs = self._run(ids, use_tqdm)
        self._use_logprob_objects(outputs, params)
        return outputs

    def _use_logprob_objects(self, outputs: list[RequestOutput],
                             params: list[SamplingParams]) -> None:
        """Offline logprobs as vLLM's ``Logprob`` objects (.logprob, .rank, .decoded_token)."""
        tok = self.get_tokenizer()
        cache: dict[int, str] = {}

        def decode(t: int) -> str:
            if t not in cache:
                cache[t] = tok.decode([t])
            return cache[t]

        for out, p in zip(outputs, params):
            if p.logprobs is not None or p.prompt_logprobs is not None:
                out.use_logprob_objects(p.logprobs, p.prompt_logprobs, decode)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list) and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(ids)
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
