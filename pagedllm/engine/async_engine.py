"""AsyncLLMEngine: the LLMEngine behind an asyncio API, for servers.

One background task owns the engine. It applies queued adds/aborts, runs ``step()`` on a single
dedicated thread (so the event loop stays responsive while the model runs) and routes each step's
RequestOutputs to per-request streams. ``step()`` therefore never runs on two threads, and engine
state is only touched while no step is in flight. An exception inside a step fails every in-flight
request with EngineDeadError and marks the engine dead; it is logged and re-raised to each caller.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedllm.engine.llm_engine import EngineStats, LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# called on the event loop after every step with the engine stats and the step's outputs
StepListener = Callable[[EngineStats, list[RequestOutput]], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the engine was shut down)."""


class AsyncStream:
    """The outputs of one request, fed by the engine loop and read by one async iterator.

    Outputs are cumulative (like vLLM). Iteration ends after the finished output; an engine error
    is raised from ``__anext__``. ``abort()`` is the consumer walking away (client disconnect): the
    request is aborted in the engine and nothing more is delivered.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None], final_only: bool = False
                 ) -> None:
        self.request_id = request_id
        self.final_only = final_only
        self.finished = False  # the last item (finished output or error) has been put
        self._on_abort = on_abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
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
        self._queue.put_nowait(item)

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
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item


class AsyncLLMEngine:
    """``async for out in engine.generate(prompt, params, request_id)`` over a shared LLMEngine."""

    def __init__(self, engine: LLMEngine, log_requests: bool = True,
                 start_engine_loop: bool = True) -> None:
        self.engine = engine
        self.log_requests = log_requests
        self.start_engine_loop = start_engine_loop
        self._streams: dict[str, AsyncStream] = {}
        self._ops: deque[tuple[str, Any]] = deque()  # ("add", kwargs) | ("abort", request_id)
        self._listeners: list[StepListener] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = engine.stats()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True
                         ) -> AsyncLLMEngine:
        """Build the LLMEngine (loads the model; blocking) and wrap it."""
        log_requests = not getattr(engine_args, "disable_log_requests", False)
        base = {k: v for k, v in vars(engine_args).items() if k in EngineArgs.__dataclass_fields__}
        engine = LLMEngine.from_engine_args(EngineArgs(**base))
        return cls(engine, log_requests=log_requests, start_engine_loop=start_engine_loop)

    # --- state ---------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine loop died, or the executor's error if a worker is gone."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead
        self.engine.executor.check_health()

    async def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def get_model_config(self) -> Any:
        return self.engine.config.model

    def get_stats(self) -> EngineStats:
        """Engine stats as of the end of the last step (block usage, queue lengths, preemptions)."""
        return self._stats

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(stats, outputs)`` on the event loop after every step (metrics)."""
        self._listeners.append(listener)

    # --- the background loop -------------------------------------------------------------
    def start_background_loop(self) -> None:
        """Start the engine loop on the running event loop (idempotent)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead
        if self.is_running:
            return
        self._stopping = False
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(),
                                                                 name="pagedllm-engine-loop")

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
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
                    pending = loop.run_in_executor(self._thread, self._step)
                outputs, stats = await pending
                self._stats = stats
                # start the next step before routing this one's outputs, so they overlap
                pending = None
                if not self._stopping:
                    self._apply_ops()
                    if self.engine.has_unfinished_requests():
                        pending = loop.run_in_executor(self._thread, self._step)
                self._dispatch(outputs, stats)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a step raised: every request fails, the engine is dead
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            self._fail_all(exc)

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
            try:
                self.engine.add_request(**payload)
            except Exception as exc:  # a bad request fails alone
                stream = self._streams.pop(payload["request_id"], None)
                if stream is not None:
                    stream.put(exc)

    def _dispatch(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
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

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        err = EngineDeadError(f"the engine is dead: step raised {exc!r}")
        err.__cause__ = exc
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()
        self._ops.clear()

    # --- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | None = None, priority: int = 0,
                          final_only: bool = False) -> AsyncStream:
        """Validate and queue a request; returns the stream of its outputs.

        Raises ValueError for a bad prompt or a request id in use, EngineDeadError when dead.
        With ``final_only`` only the finished output is delivered.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if not self.is_running:
            if not self.start_engine_loop:
                raise RuntimeError("the engine loop is not running: call start_background_loop()")
            self.start_background_loop()
        request_id = str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        text, token_ids = self._tokenize(prompt)
        self.engine.validate_prompt(token_ids)  # reads only constants: safe while a step runs
        params = params if params is not None else SamplingParams()
        stream = AsyncStream(request_id, self._abort_nowait, final_only=final_only)
        self._streams[request_id] = stream
        self._ops.append(("add", dict(request_id=request_id, params=params, priority=priority,
                                      prompt={"prompt": text, "prompt_token_ids": token_ids},
                                      arrival_time=time.time())))
        if self.log_requests:
            logger.info("added request %s: %d prompt tokens, %s", request_id, len(token_ids), params)
        self._wakeup.set()  # type: ignore[union-attr]
        return stream

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.engine.tokenizer(prompt).input_ids)
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
        """Stream the request's cumulative outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _abort_nowait(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self._dead is None:
            self._ops.append(("abort", request_id))
            if self._wakeup is not None:
                self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream gets a final output with finish_reason "abort"."""
        if self._dead is not None or str(request_id) not in self._streams:
            return
        self._ops.append(("abort", str(request_id)))
        if self._wakeup is not None:
            self._wakeup.set()

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
        if self._streams:
            err = EngineDeadError("the engine was shut down")
            for stream in self._streams.values():
                stream.put(err)
            self._streams.clear()
        self._thread.shutdown(wait=True)
        self.engine.shutdown()
