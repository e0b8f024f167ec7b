"""AsyncLLMEngine: the LLMEngine behind an asyncio API, for servers.

One background task owns the engine. It applies queued adds/aborts, runs ``step()`` on a single
dedicated thread (so the event loop stays responsive while the model runs) and routes each step's
RequestOutputs to per-request streams. ``step()`` therefore never runs on two threads, and engine
state is only touched while no step is in flight. An exception inside a step fails every in-flight
request with EngineDeadError and marks the engine dead; it is logged and re-raised to each caller.

AsyncEngineBase holds what does not depend on where the engine runs (streams, request checks,
routing outputs, metrics listeners); the server's engine-process client
(pagedllm.entrypoints.openai.engine_client) is its other subclass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import EngineStats, LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# called on the event loop after every step with the engine stats and the step's outputs
StepListener = Callable[[EngineStats, list[RequestOutput]], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the engine was shut down)."""


@dataclass
class ModelInfo:
    """What a front end needs to know about the engine's model and cache."""

    max_model_len: int
    vocab_size: int
    tokenizer: str  # path


class AsyncStream:
    """The outputs of one request, fed by the engine loop and read by one async iterator.

    Outputs are what the request's ``SamplingParams.output_kind`` asks for: cumulative (the
    default, as vLLM), deltas or the final one only. Iteration ends after the finished output; an engine error
    is raised from ``__anext__``. ``abort()`` is the consumer walking away (client disconnect): the
    request is aborted in the engine and nothing more is delivered.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None], final_only: bool = False
                 ) -> None:
        self.request_id = request_id
        self.final_only = final_only
        self.finished = False  # the last item (finished output or error) has been put
        self._on_abort = on_abort
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future | None = None  # the consumer waiting for an item
        self._ended = False  # the consumer has seen the last item

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        if isinstance(item, RequestOutput):
            if item.finished:
                self.finished = True
            elif self.final_only:
                return
        else:
            self.finished = True
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def abort(self) -> None:
        """Abort the request in the engine (its KV blocks are freed); idempotent."""
        if not self.finished:
            self.finished = True
            self._ended = True
            self._on_abort(self.request_id)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item


class AsyncEngineBase:
    """Requests, streams and output routing; subclasses run the engine and move ops/outputs."""

    def __init__(self, tokenizer: Any, model_info: ModelInfo, stats: EngineStats,
                 log_requests: bool = True) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.log_requests = log_requests
        self._streams: dict[str, AsyncStream] = {}
        self._listeners: list[StepListener] = []
        self._stats = stats
        self._stopping = False
        self._dead: BaseException | None = None
        # engine calls awaiting their result (add_lora, ...): failed if the engine dies
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()

    # --- what a subclass provides --------------------------------------------------------
    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def start_background_loop(self) -> None:
        raise NotImplementedError

    def _check_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError for a prompt the engine would reject."""
        raise NotImplementedError

    def _send_add(self, request: dict[str, Any]) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _send_call(self, call_id: int, method: str, args: tuple) -> None:
        """Run ``LLMEngine.<method>(*args)`` between steps; the result comes to _call_done."""
        raise NotImplementedError

    # --- calls into the engine between steps (LoRA adapters) -----------------------------
    ENGINE_CALLS = ("add_lora", "remove_lora", "list_loras")

    async def _call_engine(self, method: str, *args: Any) -> Any:
        if method not in self.ENGINE_CALLS:
            raise ValueError(f"{method!r} is not an engine call; allowed: "
                             f"{', '.join(self.ENGINE_CALLS)}")
        self._raise_if_dead()
        if not self.is_running:
            self.start_background_loop()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send_call(call_id, method, args)
        return await future

    def _call_done(self, call_id: int, value: Any, error: BaseException | None) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    async def add_lora(self, lora_request: Any) -> bool:
        """Check a LoRA adapter against the model and load it on the workers (vLLM's
        add_lora); ValueError naming the problem, the engine keeps running."""
        return await self._call_engine("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call_engine("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self._call_engine("list_loras")

    # --- state ---------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine died."""
        self._raise_if_dead()

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        """Engine stats as of the end of the last step (block usage, queue lengths, preemptions)."""
        return self._stats

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(stats, outputs)`` on the event loop after every step (metrics)."""
        self._listeners.append(listener)

    # --- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | None = None, priority: int = 0,
                          final_only: bool = False, lora_request: Any = None) -> AsyncStream:
        """Validate and queue a request; returns the stream of its outputs.

        Raises ValueError for a bad prompt or a request id in use, EngineDeadError when dead.
        With ``final_only`` only the finished output is delivered (the engine builds no other:
        the request runs as ``RequestOutputKind.FINAL_ONLY``).
        """
        self._raise_if_dead()
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if not self.is_running:
            if not getattr(self, "start_engine_loop", True):
                raise RuntimeError("the engine loop is not running: call start_background_loop()")
            self.start_background_loop()
        request_id = str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        params = params if params is not None else SamplingParams()
        if final_only and params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        stream = AsyncStream(request_id, self._abort_nowait, final_only=final_only)
        self._streams[request_id] = stream
        request = dict(request_id=request_id, params=params, priority=priority,
                       prompt={"prompt": text, "prompt_token_ids": token_ids},
                       arrival_time=time.time())
        if lora_request is not None:  # the LoRA adapter it runs with (checked by the engine)
            request["lora_request"] = lora_request
        self._send_add(request)
        if self.log_requests:
            logger.info("added request %s: %d prompt tokens, n=%d max_tokens=%s temperature=%s",
                        request_id, len(token_ids), params.n, params.max_tokens, params.temperature)
        return stream

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict with "
                         f"'prompt_token_ids'; got {type(prompt).__name__}")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (cumulative by default; ``output_kind`` DELTA streams only
        what is new); closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _abort_nowait(self, request_id: str, reason: str = "abort") -> None:
        if self._streams.pop(request_id, None) is not None and self.log_requests:
            logger.info("finished request %s: %s", request_id, reason)  # as _dispatch logs it
        if self._dead is None:
            self._send_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream gets a final output with finish_reason "abort"."""
        if self._dead is None and str(request_id) in self._streams:
            self._send_abort(str(request_id))

    # --- outputs -------------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # the consumer went away (aborted)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                if self.log_requests:
                    logger.info("finished request %s: %s", out.request_id,
                                ",".join(str(c.finish_reason) for c in out.outputs))
        for listener in self._listeners:
            try:
                listener(stats, outputs)
            except Exception:
                logger.exception("step listener %r failed", listener)

    def fail_all_requests(self, exc: BaseException) -> None:
        """End every request's stream with ``exc`` and abort it in the engine (the server's
        shutdown deadline); the engine keeps running."""
        for request_id, stream in list(self._streams.items()):
            stream.put(exc)
            self._abort_nowait(request_id, reason="shutdown")

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _die(self, exc: BaseException) -> None:
        """The engine failed: every request fails with EngineDeadError, and so will new ones."""
        self._dead = exc
        err = EngineDeadError(f"the engine is dead: {exc!r}")
        err.__cause__ = exc
        self._fail_all(err)
        for call_id in list(self._calls):
            self._call_done(call_id, None, err)

    def _fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()


def _engine_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")


class AsyncLLMEngine(AsyncEngineBase):
    """``async for out in engine.generate(prompt, params, request_id)`` over an in-process engine."""

    def __init__(self, engine: LLMEngine, log_requests: bool = True,
                 start_engine_loop: bool = True, engine_thread: ThreadPoolExecutor | None = None
                 ) -> None:
        """``engine_thread``: the one-worker pool that runs ``step()``; from_engine_args builds the
        engine on it too (see there)."""
        model = engine.config.model
        super().__init__(engine.get_tokenizer(),
                         ModelInfo(model.max_model_len, model.get_vocab_size(), model.tokenizer),
                         engine.stats(), log_requests)
        self.engine = engine
        self.start_engine_loop = start_engine_loop
        self._ops: deque[tuple[str, Any]] = deque()  # ("add", kwargs) | ("abort", request_id)
        self._thread = engine_thread or _engine_thread()
        self._loop_task: asyncio.Task | None = None
        self._inflight: Future | None = None  # the step running on the engine thread, if any
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True
                         ) -> AsyncLLMEngine:
        """Build the LLMEngine (loads the model; blocking) and wrap it.

        The engine is built on the thread that will run its steps: on CPU, torch's OpenMP thread
        pool belongs to the thread that first runs parallel work, and loading on one thread and
        stepping on another cost ~25% of decode throughput (bench99m, 16 cores).
        """
        log_requests = not getattr(engine_args, "disable_log_requests", False)
        thread = _engine_thread()
        try:
            engine = thread.submit(LLMEngine.from_engine_args, base_engine_args(engine_args)
                                   ).result()
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(engine, log_requests=log_requests, start_engine_loop=start_engine_loop,
                   engine_thread=thread)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine loop died, or the executor's error if a worker is gone."""
        self._raise_if_dead()
        self.engine.executor.check_health()

    def _check_prompt(self, token_ids: list[int]) -> None:
        self.engine.validate_prompt(token_ids)  # reads only constants: safe while a step runs

    def _send_add(self, request: dict[str, Any]) -> None:
        self._ops.append(("add", request))
        self._wakeup.set()  # type: ignore[union-attr]

    def _send_abort(self, request_id: str) -> None:
        self._ops.append(("abort", request_id))
        if self._wakeup is not None:
            self._wakeup.set()

    def _send_call(self, call_id: int, method: str, args: tuple) -> None:
        self._ops.append(("call", (call_id, method, args)))
        self._wakeup.set()  # type: ignore[union-attr]

    # --- the background loop -------------------------------------------------------------
    def start_background_loop(self) -> None:
        """Start the engine loop on the running event loop (idempotent)."""
        self._raise_if_dead()
        if self.is_running:
            return
        loop = asyncio.get_running_loop()
        if self._streams and self._loop is not loop:
            # streams of an event loop that is gone: nobody can read them; stop their requests
            self._ops.extend(("abort", rid) for rid in self._streams)
            self._streams.clear()
        self._loop = loop
        self._stopping = False
        self._wakeup = asyncio.Event()
        self._loop_task = loop.create_task(self._run_loop(), name="pagedllm-engine-loop")

    def _submit_step(self) -> asyncio.Future:
        self._inflight = self._thread.submit(self._step)
        return asyncio.wrap_future(self._inflight)

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        if self._inflight is not None and not self._inflight.done():
            # a previous loop was cancelled mid-step: never touch the engine while it runs
            await asyncio.wrap_future(self._inflight)
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    if self._stopping:
                        return
                    if not self._ops and not self.engine.has_unfinished_requests():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    self._apply_ops()
                    pending = self._submit_step()
                outputs, stats = await pending
                # start the next step before routing this one's outputs, so they overlap
                pending = None
                if not self._stopping:
                    self._apply_ops()
                    if self.engine.has_unfinished_requests():
                        pending = self._submit_step()
                self._dispatch(outputs, stats)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a step raised: every request fails, the engine is dead
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            self._ops.clear()
            self._die(exc)

    def _step(self) -> tuple[list[RequestOutput], EngineStats]:
        outputs = self.engine.step()
        return outputs, self.engine.stats()

    def _apply_ops(self) -> None:
        """Adds and aborts, in the order they were made; only called while no step runs."""
        while self._ops:
            kind, payload = self._ops.popleft()
            if kind == "abort":
                self.engine.abort_request(payload)
                continue
            if kind == "call":
                call_id, method, args = payload
                try:
                    value = getattr(self.engine, method)(*args)
                except Exception as exc:  # a bad adapter fails its call alone
                    self._call_done(call_id, None, exc)
                else:
                    self._call_done(call_id, value, None)
                continue
            try:
                self.engine.add_request(**payload)
            except Exception as exc:  # a bad request fails alone
                self._fail_request(payload["request_id"], exc)

    async def shutdown(self) -> None:
        """Stop the loop after the current step, fail what is left, release the workers."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._thread.shutdown(wait=True)
        self.engine.shutdown()


def base_engine_args(engine_args: EngineArgs) -> EngineArgs:
    """The plain EngineArgs fields of ``engine_args`` (an AsyncEngineArgs has a few more)."""
    fields = EngineArgs.__dataclass_fields__
    return EngineArgs(**{k: v for k, v in vars(engine_args).items() if k in fields})
