"""The server's engine in its own process (vLLM's "frontend multiprocessing").

The HTTP event loop and the engine's step loop share no GIL this way: in one process, the loop's
per-token work (SSE chunks, socket writes) stalls the step thread each time it needs the GIL,
which cost a third of decode throughput at 32 streams (bench99m, cpu). The engine process runs
``step()`` on its main thread (as pagedllm.LLM does) and sends, per step, the new tokens and text
of each request: the engine runs streamed requests as ``RequestOutputKind.DELTA``, so the engine,
the pipe and the client each do O(new tokens) per request and step. MPEngineClient hands the
deltas on as they are (DELTA, FINAL_ONLY) and rebuilds cumulative outputs only for a consumer
that asked for CUMULATIVE.

Messages, engine -> client: ("ready", ModelInfo, EngineStats) | ("failed", message) |
("step", EngineStats, [delta, ...]) | ("error", request_id, message) | ("dead", message) |
("reply", call_id, ok, value or message).
Client -> engine: ("ops", [("add", kwargs) | ("abort", request_id) |
("call", (call_id, method, args)), ...]) | ("shutdown",); a call runs an allowed LLMEngine method
between steps (AsyncEngineBase.ENGINE_CALLS: the LoRA adapters' add / remove / list).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.lifecycle import kill_process_tree
from pagedllm.logger import configure_logging
from pagedllm.engine.async_engine import (AsyncEngineBase, EngineDeadError, ModelInfo,
                                          base_engine_args)
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0  # the engine stops after its current step; a longer wait means it hangs

# (index, text, token ids, logprobs | None, cumulative logprob, finish, stop reason): what is new
# since the request's previous message (whole for a FINAL_ONLY or CUMULATIVE best_of > n request)
ChoiceDelta = tuple[int, str, list[int], list | None, float | None, str | None, Any]
# (request id, finished, metrics, prompt logprobs (first message only), choices)
Delta = tuple[str, bool, tuple, list | None, list[ChoiceDelta]]


# --- the engine process ----------------------------------------------------------------------
def encode_delta(out: RequestOutput) -> Delta:
    """A RequestOutput as plain tuples for the pipe (the client has the prompt; a DELTA request's
    prompt logprobs come with its first output only)."""
    m = out.metrics
    metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
               m.finished_time) if m is not None else ()
    choices = [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason,
                c.stop_reason) for c in out.outputs]
    return (out.request_id, out.finished, metrics, out.prompt_logprobs, choices)


def engine_main(engine_args: EngineArgs, conn: Connection) -> None:
    """The engine process: build the engine, then step whenever there is work."""
    # the server drains, then stops us; a signal to the whole process group must not cut the
    # drain short (the process exits on its own when the server goes away: recv() gets EOF)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging()
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which exits
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    from pagedllm.engine.gc_freeze import freeze_for_process

    freeze_for_process()  # this process steps the engine until it exits
    model = engine.config.model
    conn.send(("ready", ModelInfo(model.max_model_len, model.get_vocab_size(), model.tokenizer),
               engine.stats()))
    try:
        while True:
            if not _apply_messages(engine, conn, block=not engine.has_unfinished_requests()):
                break
            outputs = engine.step()
            for out in outputs:  # a request the engine failed on its own (grammar timeout)
                if out.error is not None:
                    conn.send(("error", out.request_id, out.error))
            conn.send(("step", engine.stats(),
                       [encode_delta(o) for o in outputs if o.error is None]))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone
    except Exception as exc:  # noqa: BLE001 - a failed step: tell the server, then exit
        logger.error("engine step failed:\n%s", traceback.format_exc())
        try:
            conn.send(("dead", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    engine.shutdown()


def _apply_messages(engine: Any, conn: Connection, block: bool) -> bool:
    """Apply every pending message (waiting for one when idle); False once told to stop."""
    while block or conn.poll():
        block = False
        message = conn.recv()
        if message[0] == "shutdown":
            return False
        for kind, payload in message[1]:
            if kind == "abort":
                engine.abort_request(payload)
                continue
            if kind == "call":
                call_id, method, args = payload
                try:
                    if method not in AsyncEngineBase.ENGINE_CALLS:
                        raise ValueError(f"{method!r} is not an engine call")
                    conn.send(("reply", call_id, True, getattr(engine, method)(*args)))
                except Exception as exc:  # noqa: BLE001 - a bad adapter fails its call alone
                    conn.send(("reply", call_id, False, f"{exc}"))
                continue
            try:
                engine.add_request(**payload)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                conn.send(("error", payload["request_id"], f"{exc}"))
    return True


# --- the client, in the server process -------------------------------------------------------
class _Request:
    """What the client keeps of one request: its prompt and, where the consumer asked for
    CUMULATIVE outputs and the engine sends deltas, the outputs so far."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int], accumulate: bool,
                 prompt_every_time: bool) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.accumulate = accumulate
        self.prompt_every_time = prompt_every_time  # the consumer's outputs are not deltas
        self.first = True
        self.prompt_logprobs: list | None = None
        self.choices: dict[int, list[Any]] = {}  # index -> [text, ids, logprobs] (cumulative)

    def apply(self, request_id: str, delta: Delta) -> RequestOutput:
        _, finished, metrics, prompt_logprobs, choices = delta
        first, self.first = self.first, False
        if self.accumulate:
            return self._accumulate(request_id, delta, first)
        outputs = [CompletionOutput(index, text, ids, cum, logprobs, finish, stop)
                   for index, text, ids, logprobs, cum, finish, stop in choices]
        with_prompt = first or self.prompt_every_time
        return RequestOutput(request_id, self.prompt if with_prompt else None,
                             self.prompt_token_ids if with_prompt else None, prompt_logprobs,
                             outputs, finished,
                             metrics=RequestMetrics(*metrics) if metrics else None)

    def _accumulate(self, request_id: str, delta: Delta, first: bool) -> RequestOutput:
        _, finished, metrics, prompt_logprobs, choices = delta
        if first:
            self.prompt_logprobs = prompt_logprobs
        outputs = []
        for index, text, ids, logprobs, cum, finish, stop in choices:
            state = self.choices.get(index)
            if state is None:
                state = self.choices[index] = ["", [], None if logprobs is None else []]
            state[0] += text
            state[1] = state[1] + ids  # a new list: earlier outputs stay as they were
            if logprobs is not None:
                state[2] = state[2] + logprobs
            outputs.append(CompletionOutput(index, state[0], state[1], cum, state[2], finish, stop))
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             outputs, finished,
                             metrics=RequestMetrics(*metrics) if metrics else None)


class MPEngineClient(AsyncEngineBase):
    """AsyncEngineBase over an engine process; the in-process AsyncLLMEngine's API."""

    def __init__(self, engine_args: EngineArgs, startup_timeout: float = 3600.0) -> None:
        from pagedllm.entrypoints.openai.lifecycle import engine_process_main, stop_at_exit

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not daemonic: a daemonic process may not start TP/PP workers (lifecycle.py says what
        # ends it instead)
        self._proc = ctx.Process(target=engine_process_main,
                                 args=(engine_main, base_engine_args(engine_args), child),
                                 name="pagedllm-engine", daemon=False)
        self._proc.start()
        stop_at_exit(self._proc)
        child.close()
        message = self._receive_startup(startup_timeout)
        if message[0] != "ready":
            self._proc.join(10)
            raise RuntimeError(message[1])
        _, info, stats = message
        from pagedllm.engine.tokenizer import get_tokenizer

        super().__init__(get_tokenizer(info.tokenizer), info, stats,
                         log_requests=not getattr(engine_args, "disable_log_requests", False))
        self._vocab = info.vocab_size
        self._requests: dict[str, _Request] = {}
        self._ops: list[tuple[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False

    def _receive_startup(self, timeout: float) -> tuple:
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.join(10)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} "
                               "while loading the model (see its log above)") from None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> MPEngineClient:
        return cls(engine_args)

    @property
    def is_running(self) -> bool:
        return self._reading and self._dead is None

    async def check_health(self) -> None:
        self._raise_if_dead()
        if not self._proc.is_alive():
            raise EngineDeadError(f"the engine process exited with code {self._proc.exitcode}")

    def start_background_loop(self) -> None:
        self._raise_if_dead()
        if self._reading:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        self._reading = True

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self._vocab),
                   None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range: token ids must be in "
                             f"[0, {self._vocab - 1}]")
        if len(token_ids) > self.model_info.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.model_info.max_model_len}")

    # --- moving ops and outputs ------------------------------------------------------------
    def _send_add(self, request: dict[str, Any]) -> None:
        prompt, params = request["prompt"], request["params"]
        kind = params.output_kind
        # a CUMULATIVE consumer: the engine sends deltas and this client rebuilds the outputs
        # (but best_of > n: the best n are known only at the end, so they come whole)
        accumulate = kind == RequestOutputKind.CUMULATIVE and params.best_of == params.n
        if accumulate:
            request = {**request, "params": dataclasses.replace(
                params, output_kind=RequestOutputKind.DELTA)}
        self._requests[request["request_id"]] = _Request(
            prompt["prompt"], prompt["prompt_token_ids"], accumulate,
            prompt_every_time=kind != RequestOutputKind.DELTA)
        self._queue_op(("add", request))

    def _send_abort(self, request_id: str) -> None:
        self._queue_op(("abort", request_id))

    def _send_call(self, call_id: int, method: str, args: tuple) -> None:
        self._queue_op(("call", (call_id, method, args)))

    def _queue_op(self, op: tuple[str, Any]) -> None:
        if not self._ops and self._loop is not None:
            self._loop.call_soon(self._flush_ops)  # one message for all ops of this loop pass
        self._ops.append(op)

    def _flush_ops(self) -> None:
        ops, self._ops = self._ops, []
        if ops and self._dead is None:
            try:
                self._conn.send(("ops", ops))
            except OSError as exc:
                self._on_engine_gone(exc)

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError) as exc:
            self._on_engine_gone(exc)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, stats, deltas = message
            outputs = []
            for delta in deltas:
                request = self._requests.get(delta[0])
                if request is None:
                    continue
                outputs.append(request.apply(delta[0], delta))
                if delta[1]:
                    del self._requests[delta[0]]
            self._dispatch(outputs, stats)
        elif kind == "error":
            self._requests.pop(message[1], None)
            self._fail_request(message[1], ValueError(message[2]))
        elif kind == "reply":
            _, call_id, ok, value = message
            self._call_done(call_id, value if ok else None, None if ok else ValueError(value))
        elif kind == "dead":
            logger.error("the engine process failed: %s", message[1])
            self._stop_reading()
            self._die(RuntimeError(message[1]))

    def _on_engine_gone(self, exc: BaseException) -> None:
        if self._dead is not None or self._stopping:
            return
        self._stop_reading()
        self._proc.join(5)
        logger.error("the engine process is gone (exit code %s)", self._proc.exitcode)
        self._die(RuntimeError(f"the engine process exited (code {self._proc.exitcode})"))

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._reading = False

    async def shutdown(self) -> None:
        """Stop the engine process (after its current step) and fail what is left."""
        self._stopping = True
        self._stop_reading()
        try:
            self._conn.send(("shutdown",))
        except OSError:
            pass
        await asyncio.to_thread(self._proc.join, SHUTDOWN_JOIN_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it",
                           SHUTDOWN_JOIN_S)
            self.kill()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._conn.close()

    def kill(self) -> None:
        """SIGKILL the engine process and its workers (it ignores SIGINT and SIGTERM, so that a
        signal to the whole process group does not cut the server's drain short)."""
        if self._proc.pid is not None and self._proc.is_alive():
            kill_process_tree(self._proc.pid)
            self._proc.join(5)
