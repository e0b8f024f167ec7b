"""LLMEngine: add requests, step (schedule -> execute -> process), abort."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.contract.registry import resolve_backend
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.config_validation import validate_config
from pagedllm.engine.guided import GuidedManager, validate_guided_params
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.speculative import SpeculativeDecoding
from pagedllm.engine.steppers import StepDone, make_stepper
from pagedllm.engine.tokenizer import get_tokenizer, stop_token_ids_of
from pagedllm.executor.factory import make_executor
from pagedllm.kv_transfer.engine import KVTransferEngine, kv_namespace
from pagedllm.lora.registry import LoRARegistry
from pagedllm.models.layers.attention import model_sliding_window
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict | list


@dataclass
class EngineStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    kv_cache_usage: float = 0.0
    # speculative decoding's counters (spec_decode/metrics.py as_dict), None without it
    spec_decode: dict | None = None
    # LoRA (vLLM's lora_requests_info): names of the adapters running / waiting requests use
    running_lora_adapters: list[str] | None = None
    waiting_lora_adapters: list[str] | None = None
    max_lora: int = 0
    # KV offload tiers / connectors (kv_transfer/engine.py stats), None without them
    kv_transfer: dict | None = None


class LLMEngine:
    """The offline engine. ``step()`` is schedule -> execute -> process, nothing more: the
    stepper chosen at start (engine/steppers/) schedules and executes in the engine's mode
    (plain, scheduled ahead, pipelined), the output processor applies what came back."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backend = resolve_backend(config.device)
        config.device = self.backend.name
        self.backend.check_and_update_config(config)
        validate_config(config, self.backend)  # model, capabilities, parallel layout
        # LoRA adapters: each checked against the model before a request runs it
        self.lora = LoRARegistry(config) if config.lora_config is not None else None
        self.tokenizer = get_tokenizer(config.model.tokenizer)
        self.eos_token_ids = stop_token_ids_of(self.tokenizer, config.model.model)
        # speculative decoding (engine/speculative.py): its workers, classes and stepper below
        self.speculative = (SpeculativeDecoding(config, self.backend)
                            if config.speculative_config is not None else None)
        self.executor = make_executor(config, self.backend if self.speculative is None
                                      else self.speculative.backend)
        num_device, num_host = self.executor.determine_num_blocks()
        if num_device <= 0:
            raise RuntimeError("no memory left for the KV cache: lower the model size or raise "
                               "kv_cache_space_gib / gpu_memory_utilization")
        config.cache.num_device_blocks, config.cache.num_host_blocks = num_device, num_host
        self.executor.init_cache(num_device, num_host)
        # one scheduler, block manager and (on the workers) KV cache of num_device blocks per
        # virtual engine: pipeline_parallel_size of them keep that many batches in flight
        # a model whose every layer has a sliding window frees the blocks behind it early,
        # where the backend's attention runs the window (it then never reads them as keys)
        window = (model_sliding_window(config.model.hf_config, config.model.max_model_len)
                  if "sliding_window" in self.backend.capabilities.attention_features else None)
        scheduler_cls, block_manager_cls = ((Scheduler, BlockManager) if self.speculative is None
                                            else (self.speculative.scheduler_cls,
                                                  self.speculative.block_manager_cls))
        self.schedulers = [
            scheduler_cls(config.scheduler,
                          block_manager_cls(config.cache.block_size, num_device, num_host,
                                            enable_caching=config.cache.enable_prefix_caching,
                                            sliding_window=window,
                                            key_namespace=kv_namespace(config)),
                          can_swap=self.backend.capabilities.swap)
            for _ in range(config.parallel.pipeline_parallel_size)]
        self.scheduler = self.schedulers[0]
        self.block_manager = self.scheduler.block_manager
        # KV offload tiers and KV connectors (kv_transfer/engine.py), None without them
        self.kv = KVTransferEngine.create(config, self.executor, self.schedulers)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                config.model.max_model_len)
        self._requests: dict[str, SequenceGroup] = {}
        # guided requests wait here while their grammar compiles, then join the scheduler
        # the matcher job overlaps the forward where the device runs apart from the host
        self.guided = GuidedManager(self.tokenizer, config.model.get_vocab_size(),
                                    self.eos_token_ids,
                                    overlap=self.backend.capabilities.async_output)
        self._pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step
        self._seq_ids = itertools.count()
        self._error: BaseException | None = None
        self.stepper = (make_stepper(config, self.backend, self.executor, self.schedulers,
                                     self.guided) if self.speculative is None
                        else self.speculative.make_stepper(self.schedulers, self.executor,
                                                           self.guided))
        logger.info("engine ready: backend=%s dtype=%s blocks=%d (host %d) block_size=%d "
                    "stepper=%s", self.backend.name, config.model.dtype, num_device, num_host,
                    config.cache.block_size, type(self.stepper).__name__)

    @property
    def num_steps_ahead(self) -> int:
        """Steps launched before the previous one's outputs were read (scheduled ahead)."""
        return self.stepper.num_steps_ahead

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # --- requests ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict with "
                         f"'prompt_token_ids'; got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        vocab = self.config.model.get_vocab_size()
        fast = (set(map(type, token_ids)) <= {int} and min(token_ids) >= 0
                and max(token_ids) < vocab)  # C loops; the list below names the culprit
        bad = [] if fast else [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range: token ids must be in "
                             f"[0, {vocab - 1}]")
        max_len = self.config.model.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{max_len}")
        bm = self.block_manager
        need = -(-len(token_ids) // bm.block_size)
        if need > bm.num_device_blocks - bm.watermark_blocks:
            raise ValueError(f"prompt needs {need} KV blocks but the cache only has "
                             f"{bm.num_device_blocks - bm.watermark_blocks} usable; raise the "
                             f"KV cache size")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: Any = None) -> None:
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request was given but enable_lora=False; create the engine "
                                 "with enable_lora=True to run adapters")
            self.lora.check(lora_request)  # ValueError naming what is wrong with the adapter
        params = (params or SamplingParams()).clone()
        text, token_ids = self._prompt_ids(prompt)
        self.validate_prompt(token_ids)
        self._prepare_logits_controls(params)
        if params.max_tokens is None:
            params.max_tokens = max(1, self.config.model.max_model_len - len(token_ids))
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids
        now = time.time()
        seq = Sequence(next(self._seq_ids), token_ids)
        if lora_request is not None:
            seq.lora_int_id = lora_request.lora_int_id  # the prefix cache's key root
        self.output_processor.start(seq, params)
        group = SequenceGroup(
            request_id=request_id, seqs=[seq], sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else now, prompt=text,
            priority=priority,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else now),
            deadline=(time.monotonic() + params.timeout_seconds
                      if params.timeout_seconds is not None else None),
            lora_request=lora_request)
        self._requests[request_id] = group
        if params.guided_decoding is not None:
            self.guided.add(group)  # joins the scheduler once its grammar is compiled
        else:
            self.stepper.add(group)

    def _prepare_logits_controls(self, params: SamplingParams) -> None:
        """Checks token ids against the vocabulary, tokenizes bad_words and parses the guided
        constraint (ValueError naming the field)."""
        vocab = self.config.model.get_vocab_size()
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of range: token ids must be "
                                 f"in [0, {vocab - 1}]")
        words: list[list[int]] = []
        for word in params.bad_words or []:
            for text in (word.lstrip(), " " + word.lstrip()):  # as vLLM: with and without a space
                ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids and ids not in words and max(ids) < vocab:
                    words.append(ids)
        params.bad_words_token_ids = words
        if params.guided_decoding is not None:
            validate_guided_params(params.guided_decoding)

    def abort_request(self, request_id: str | list[str] | set[str]) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for group in self.guided.abort(ids):
            self._finish_unscheduled(group)
        for group in [g for s in self.schedulers for g in s.abort(ids)]:
            self._requests.pop(group.request_id, None)
            self._pending_outputs.append(self.output_processor.make_output(group))

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the stepper schedules and executes (in its mode), then the outputs that are
        on the host are processed."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed earlier and cannot continue: {self._error}")
        self._admit_guided()
        try:
            done = self.stepper.step()
            if self.kv is not None:
                self.kv.after_step(done)
        except BaseException as exc:
            # the scheduler already counted the step's tokens as computed: state is unusable
            self._error = exc
            raise
        return self._process(done)

    def _admit_guided(self) -> None:
        """Requests whose grammar is compiled join the scheduler; failed ones finish with the
        error. With nothing else to run, waits a little for a compile instead of spinning."""
        if not self.guided.num_compiling:
            return
        idle = not any(s.has_unfinished() for s in self.schedulers) and not self.stepper.in_flight
        ready, failed = self.guided.pop_ready(wait_s=0.05 if idle else 0.0)
        for group in ready:  # as add_request places an unguided request
            self.stepper.add(group)
        for group, error in failed:
            logger.warning("request %s failed: %s", group.request_id, error)
            self._finish_unscheduled(group, error)

    def _finish_unscheduled(self, group: SequenceGroup, error: str | None = None) -> None:
        """A request that never reached the scheduler finishes as aborted (with ``error``)."""
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED
        self._requests.pop(group.request_id, None)
        out = self.output_processor.make_output(group)
        out.error = error
        self._pending_outputs.append(out)

    def _process(self, done: StepDone | None) -> list[RequestOutput]:
        """Apply a step's outputs (fork, detokenize, stop), free what finished, and build the
        RequestOutputs; aborts since the last step are reported here too."""
        results, self._pending_outputs = self._pending_outputs, []
        if done is None:
            return results
        self.guided.advance(done.sched, done.outputs)
        touched = self.output_processor.apply(done.sched, done.outputs, self._fork)
        done.scheduler.free_finished()
        for group in [*done.sched.timed_out, *touched]:
            finished = group.is_finished()
            if finished or group.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(self.output_processor.make_output(group))
            if finished:
                self._requests.pop(group.request_id, None)
                self.stepper.forget(group.request_id)
                self.guided.free(group.request_id)
        return results

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(next(self._seq_ids), index)
        self.stepper.block_manager_of(group).fork(parent, child)
        group.seqs.append(child)
        return child

    # --- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -------------------------
    def _lora_registry(self) -> LoRARegistry:
        if self.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.lora

    def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter against the model and load it on every worker ahead of its
        requests; ValueError naming the problem (the engine keeps running)."""
        registry = self._lora_registry()
        registry.check(lora_request)
        self.executor.add_lora(lora_request)
        registry.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (its requests already running finish with it; the workers load it
        again from its path should they need it)."""
        registry = self._lora_registry()
        found = registry.remove(lora_id)
        return self.executor.remove_lora(lora_id) or found

    def list_loras(self) -> set[int]:
        """Ids of the adapters added with add_lora."""
        return set(self._lora_registry().registered)

    # --- introspection -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (any(s.has_unfinished() for s in self.schedulers) or bool(self._pending_outputs)
                or self.stepper.in_flight or self.guided.num_compiling > 0)

    def get_num_unfinished_requests(self) -> int:
        return sum(s.num_unfinished() for s in self.schedulers) + self.guided.num_compiling

    def stats(self) -> EngineStats:
        """Totals over the engine's schedulers (one per virtual engine)."""
        bms = [x.block_manager for x in self.schedulers]
        return EngineStats(
            num_blocks=sum(b.num_device_blocks for b in bms),
            num_free_blocks=sum(b.device.num_free for b in bms),
            num_cached_blocks=sum(b.device.num_cached_idle for b in bms),
            block_size=self.block_manager.block_size,
            num_running=sum(len(x.running) for x in self.schedulers),
            num_waiting=sum(len(x.waiting) for x in self.schedulers),
            num_swapped=sum(len(x.swapped) for x in self.schedulers),
            num_preemptions=sum(x.num_preemptions for x in self.schedulers),
            kv_cache_usage=sum(b.usage() for b in bms) / len(bms),
            spec_decode=(self.stepper.metrics.as_dict() if self.speculative is not None
                         else None),
            kv_transfer=self.kv.stats() if self.kv is not None else None,
            **self._lora_stats())

    def _lora_stats(self) -> dict[str, Any]:
        """Adapter names of running and waiting requests (vLLM's lora_requests_info)."""
        if self.lora is None:
            return {}

        def names(groups: Any) -> list[str]:
            return sorted({g.lora_request.lora_name for g in groups
                           if g.lora_request is not None})

        return dict(running_lora_adapters=names(g for s in self.schedulers for g in s.running),
                    waiting_lora_adapters=names(g for s in self.schedulers
                                                for g in (*s.waiting, *s.swapped)),
                    max_lora=self.config.lora_config.max_loras)

    def shutdown(self) -> None:
        """Stop the workers and release the model and KV cache (device memory too);
        idempotent. ``del engine`` followed by ``gc.collect()`` frees the same."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self.guided.shutdown()
        if getattr(self, "kv", None) is not None:
            self.kv.shutdown()
        self.executor.shutdown()
