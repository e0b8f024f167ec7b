"""LLMEngine: add requests, step (schedule -> execute -> process), abort."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.backends.registry import resolve_backend
from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.batch import ScheduledBatch
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.guided import GuidedManager, validate_guided_params
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.tokenizer import get_tokenizer, stop_token_ids_of
from pagedllm.engine.virtual_engines import VirtualEngines
from pagedllm.executor.base import make_executor
from pagedllm.models.layers.attention import model_sliding_window
from pagedllm.models.registry import check_model_supported
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.worker.pending import PendingOutputs

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


class LLMEngine:
    """The offline engine. ``step()`` is schedule -> execute -> process, nothing more."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backend = resolve_backend(config.device)
        config.device = self.backend.name
        self.backend.check_and_update_config(config)
        check_model_supported(config.model.hf_config, self.backend)  # before any loading
        self.tokenizer = get_tokenizer(config.model.tokenizer)
        self.eos_token_ids = stop_token_ids_of(self.tokenizer, config.model.model)
        self.executor = make_executor(config, self.backend)
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
        self.schedulers = [
            Scheduler(config.scheduler,
                      BlockManager(config.cache.block_size, num_device, num_host,
                                   enable_caching=config.cache.enable_prefix_caching,
                                   sliding_window=window),
                      can_swap=self.backend.capabilities.swap)
            for _ in range(config.parallel.pipeline_parallel_size)]
        self.scheduler = self.schedulers[0]
        self.block_manager = self.scheduler.block_manager
        self.pipeline = VirtualEngines(self.schedulers) if len(self.schedulers) > 1 else None
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
        # schedule step N+1 while step N runs on the device (see Scheduler.schedule_ahead)
        self._ahead = (self.backend.capabilities.async_output and self.executor.supports_async
                       and not config.disable_async_output_proc and self.pipeline is None)
        self._inflight: tuple[SchedulerOutput, PendingOutputs] | None = None
        self.num_steps_ahead = 0  # steps launched before the previous one's outputs were read
        logger.info("engine ready: backend=%s dtype=%s blocks=%d (host %d) block_size=%d",
                    self.backend.name, config.model.dtype, num_device, num_host,
                    config.cache.block_size)

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
                    arrival_time: float | None = None, priority: int = 0) -> None:
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
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
        self.output_processor.start(seq, params)
        group = SequenceGroup(
            request_id=request_id, seqs=[seq], sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else now, prompt=text,
            priority=priority,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else now),
            deadline=(time.monotonic() + params.timeout_seconds
                      if params.timeout_seconds is not None else None))
        self._requests[request_id] = group
        if params.guided_decoding is not None:
            self.guided.add(group)  # joins the scheduler once its grammar is compiled
        else:
            (self.pipeline.assign(group) if self.pipeline else self.scheduler).add(group)

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
        """Process one step's outputs. With ``_ahead``, the next step is launched before this
        one's outputs are read, so the device never waits for this Python work."""
        if self._error is not None:
            raise RuntimeError(f"the engine failed earlier and cannot continue: {self._error}")
        self._admit_guided()
        if self.pipeline is not None:
            return self._step_pipelined()
        if self._inflight is not None:
            (sched, pending), self._inflight = self._inflight, None
        else:
            sched = self.scheduler.schedule()
            pending = None if sched.batch.is_empty() else self._launch(sched)
        # a guided sequence's next mask needs this step's token on the host: no step ahead
        if pending is not None and self._ahead and not self.guided.has_live():
            ahead = self.scheduler.schedule_ahead(sched)
            if ahead is not None:
                self._inflight = (ahead, self._launch(ahead))
                self.num_steps_ahead += 1
        outputs = [] if pending is None else self._guard(pending.result)
        self.scheduler.after_step(sched)
        return self._process(sched, outputs)

    def _admit_guided(self) -> None:
        """Requests whose grammar is compiled join the scheduler; failed ones finish with the
        error. With nothing else to run, waits a little for a compile instead of spinning."""
        if not self.guided.num_compiling:
            return
        idle = (not any(s.has_unfinished() for s in self.schedulers) and self._inflight is None
                and not (self.pipeline and self.pipeline.in_flight))
        ready, failed = self.guided.pop_ready(wait_s=0.05 if idle else 0.0)
        for group in ready:  # as add_request places an unguided request
            (self.pipeline.assign(group) if self.pipeline else self.scheduler).add(group)
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

    def _launch(self, sched: SchedulerOutput) -> PendingOutputs:
        sched.batch.token_bitmask = self.guided.bitmask(sched)
        if self.pipeline is not None:
            return self._guard(lambda: self.executor.submit(sched.batch))
        if self._ahead:
            return self._guard(lambda: self.executor.execute_async(sched.batch))
        return PendingOutputs(self._guard(lambda: self.executor.execute(sched.batch)))

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except BaseException as exc:
            # the scheduler already counted the step's tokens as computed: state is unusable
            self._error = exc
            raise

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallelism: every idle virtual engine launches its next batch, then the
        oldest batch in flight is finished, so up to pipeline_parallel_size batches are in the
        stages at once."""
        assert self.pipeline is not None
        self.pipeline.fill(self._launch)
        entry = self.pipeline.pop()
        if entry is None:  # nothing to run: report aborts
            return self._process(SchedulerOutput(batch=ScheduledBatch()), [])
        ve, sched, pending = entry
        outputs = [] if pending is None else self._guard(pending.result)
        self.schedulers[ve].after_step(sched)
        return self._process(sched, outputs, self.schedulers[ve])

    def _process(self, sched: Any, outputs: list,
                 scheduler: Scheduler | None = None) -> list[RequestOutput]:
        self.guided.advance(sched, outputs)
        touched = self.output_processor.apply(sched, outputs, self._fork)
        (scheduler or self.scheduler).free_finished()
        results, self._pending_outputs = self._pending_outputs, []
        for group in [*sched.timed_out, *touched]:
            finished = group.is_finished()
            if finished or group.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(self.output_processor.make_output(group))
            if finished:
                self._requests.pop(group.request_id, None)
                if self.pipeline is not None:
                    self.pipeline.forget(group.request_id)
                self.guided.free(group.request_id)
        return results

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(next(self._seq_ids), index)
        bm = self.pipeline.block_manager_of(group) if self.pipeline else self.block_manager
        bm.fork(parent, child)
        group.seqs.append(child)
        return child

    # --- introspection -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (any(s.has_unfinished() for s in self.schedulers) or bool(self._pending_outputs)
                or self._inflight is not None or self.guided.num_compiling > 0
                or bool(self.pipeline and self.pipeline.in_flight))

    def get_num_unfinished_requests(self) -> int:
        return sum(s.num_unfinished() for s in self.schedulers) + self.guided.num_compiling

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.scheduler
        if self.pipeline is None:
            return EngineStats(num_blocks=bm.num_device_blocks, num_free_blocks=bm.device.num_free,
                               num_cached_blocks=bm.device.num_cached_idle,
                               block_size=bm.block_size, num_running=len(s.running),
                               num_waiting=len(s.waiting), num_swapped=len(s.swapped),
                               num_preemptions=s.num_preemptions, kv_cache_usage=bm.usage())
        bms = [x.block_manager for x in self.schedulers]  # virtual engines: totals
        return EngineStats(
            num_blocks=sum(b.num_device_blocks for b in bms),
            num_free_blocks=sum(b.device.num_free for b in bms),
            num_cached_blocks=sum(b.device.num_cached_idle for b in bms), block_size=bm.block_size,
            num_running=sum(len(x.running) for x in self.schedulers),
            num_waiting=sum(len(x.waiting) for x in self.schedulers),
            num_swapped=sum(len(x.swapped) for x in self.schedulers),
            num_preemptions=sum(x.num_preemptions for x in self.schedulers),
            kv_cache_usage=sum(b.usage() for b in bms) / len(bms))

    def shutdown(self) -> None:
        self.guided.shutdown()
        self.executor.shutdown()
