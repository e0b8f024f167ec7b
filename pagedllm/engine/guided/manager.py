"""Per-request guided-decoding state on the host: the request waits here while its grammar
compiles, then each of its sequences has an xgrammar matcher that builds the sequence's row of
the step's token bitmask and accepts the token the step sampled.

Matchers are keyed by (request id, completion index), not by KV state, so they survive
preemption by recompute and by swap unchanged: a preempted sequence keeps its tokens, and the
matcher has accepted exactly those.

Where the engine asks for it (``overlap``: backends whose device runs apart from the host), the
matcher work of a step runs on one helper thread while the model's forward runs (xgrammar
releases the GIL): ``advance`` only records the sampled tokens (and forks), and ``bitmask``
starts a job that accepts them and then fills the step's rows, returning a ``PendingBitmask``
at once, which the model runner waits for only when it samples. The forward needs neither.
Invariants: at most one job is in flight; the engine thread touches the matchers and the
recorded tokens only after waiting for it (``_settle``); every guided row a step samples was
filled by that step's job, so a matcher has at most one recorded token when a job starts.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm import envs
from pagedllm.core.batch import PENDING_TOKEN, SeqOutput
from pagedllm.core.sequence import SequenceGroup
from pagedllm.engine.guided.compiler import GrammarCompileError, GrammarCompilerService

logger = logging.getLogger(__name__)

# xgrammar threads that fill one step's rows: one per 128 live rows (a thread's start-up costs
# more than a small batch's fill: 64 rows of a JSON schema took 2.6 ms on 2 threads, 0.7 ms on
# 1), at most FILL_THREADS
FILL_THREADS = max(1, min(8, os.cpu_count() or 1))
ROWS_PER_FILL_THREAD = 128


class PendingBitmask:
    """A step's int32 [rows, words] mask being filled on the guided manager's thread. The model
    runner calls ``result()`` when it samples; indexing waits for it too, and pickling (an
    executor sending the batch to another process) sends the finished tensor."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> torch.Tensor:
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.result()[index]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.result().__reduce_ex__(protocol)


@dataclass
class _Compiling:
    group: SequenceGroup
    future: Future
    deadline: float  # time.monotonic() after which the request fails


class GuidedManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._service: GrammarCompilerService | None = None  # xgrammar imported on first use
        self._compiling: list[_Compiling] = []
        self._grammars: dict[str, Any] = {}  # request id -> CompiledGrammar
        self._matchers: dict[tuple[str, int], Any] = {}  # (request id, index) -> GrammarMatcher
        self._batch: dict[int, Any] = {}  # threads -> xgrammar.BatchGrammarMatcher
        self._stop: torch.Tensor | None = None  # the row of a terminated matcher, made once
        # $PAGEDLLM_GUIDED_OVERLAP on / off: run the matcher job on the helper thread during the
        # forward / on the engine thread before it, whatever the backend; unset: ``overlap``, the
        # engine's choice (overlap where the device runs apart from the host: on a 2-core cpu box
        # the thread's hand-off cost more than the 64-row job itself, 2.2 vs 1.4 ms per step)
        forced = envs.PAGEDLLM_GUIDED_OVERLAP
        self.overlap = forced if forced is not None else overlap
        self._fill_pool: ThreadPoolExecutor | None = None
        self._fill: Future | None = None  # the step's job in flight, if any
        # (request id, matcher, token) sampled but not yet accepted: the next job accepts them
        self._accepts: list[tuple[str, Any, int]] = []

    @property
    def service(self) -> GrammarCompilerService:
        if self._service is None:
            self._service = GrammarCompilerService(self._tokenizer, self.vocab_size,
                                                   self._stop_token_ids)
        return self._service

    # --- requests ------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        """Start compiling ``group``'s grammar; the group is handed back by ``pop_ready``."""
        params = group.sampling_params.guided_decoding
        assert params is not None
        service = self.service
        self._compiling.append(_Compiling(group, service.submit(params),
                                          time.monotonic() + service.timeout_s))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def has_live(self) -> bool:
        """Whether any guided request is past compilation (its next bitmask needs the host to
        have seen its last token: the engine does not schedule ahead of the device then)."""
        return bool(self._grammars)

    def pop_ready(self, wait_s: float = 0.0) -> tuple[list[SequenceGroup],
                                                      list[tuple[SequenceGroup, str]]]:
        """(groups whose grammar is ready, (group, error) for those that failed or timed out).
        Waits up to ``wait_s`` for a first compile to finish when none has."""
        if not self._compiling:
            return [], []
        if wait_s > 0 and not any(c.future.done() for c in self._compiling):
            wait([c.future for c in self._compiling], timeout=wait_s, return_when="FIRST_COMPLETED")
        ready: list[SequenceGroup] = []
        failed: list[tuple[SequenceGroup, str]] = []
        still: list[_Compiling] = []
        now = time.monotonic()
        for c in self._compiling:
            rid = c.group.request_id
            if not c.future.done():
                if now < c.deadline:
                    still.append(c)
                    continue
                failed.append((c.group, f"guided_decoding: grammar compilation took longer than "
                                        f"{self.service.timeout_s:g} s"))
                continue
            try:
                grammar = c.future.result(timeout=0)
            except (GrammarCompileError, ValueError, RuntimeError, FutureTimeout) as exc:
                failed.append((c.group, str(exc)))
                continue
            self._grammars[rid] = grammar
            ready.append(c.group)
        self._compiling = still
        return ready, failed

    def abort(self, request_ids: set[str]) -> list[SequenceGroup]:
        """Drop requests; returns the groups that were still compiling (never scheduled)."""
        dropped = [c.group for c in self._compiling if c.group.request_id in request_ids]
        self._compiling = [c for c in self._compiling if c.group.request_id not in request_ids]
        for rid in request_ids:
            self.free(rid)
        return dropped

    def free(self, request_id: str) -> None:
        self._settle()
        if any(rid == request_id for rid, _, _ in self._accepts):
            self._accepts = [a for a in self._accepts if a[0] != request_id]
        if self._grammars.pop(request_id, None) is not None:
            for key in [k for k in self._matchers if k[0] == request_id]:
                del self._matchers[key]

    # --- the step ------------------------------------------------------------------------
    def _matcher(self, request_id: str, index: int) -> Any:
        key = (request_id, index)
        m = self._matchers.get(key)
        if m is None:
            import xgrammar as xgr

            m = self._matchers[key] = xgr.GrammarMatcher(self._grammars[request_id])
        return m

    def bitmask(self, sched: Any) -> torch.Tensor | PendingBitmask | None:
        """int32 [len(batch.seqs), words] for ``sched`` (bit t of row i set iff token t may be
        sampled for batch.seqs[i]; rows of unguided or unsampled sequences all ones), or None
        when no sampled sequence is guided. With ``overlap`` a PendingBitmask of it, being
        filled on the helper thread."""
        self._settle()
        rows = [i for i, ((group, _), s) in enumerate(zip(sched.entries, sched.batch.seqs))
                if s.num_samples > 0 and group.request_id in self._grammars]
        if not rows:
            return None
        mask = torch.full((len(sched.batch.seqs), self.words), -1, dtype=torch.int32)
        targets: list[tuple[int, Any]] = []
        for i in rows:
            group, seq = sched.entries[i]
            if sched.batch.seqs[i].token_ids[-1] == PENDING_TOKEN:
                raise RuntimeError("a guided sequence was scheduled ahead of its last token")
            targets.append((i, self._matcher(group.request_id, seq.index)))
        if not self.overlap:
            return self._job(mask, targets)
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="pagedllm-bitmask")
        self._fill = self._fill_pool.submit(self._job, mask, targets)
        return PendingBitmask(self._fill)

    def _job(self, mask: torch.Tensor, targets: list[tuple[int, Any]]) -> torch.Tensor:
        """The recorded tokens accepted, then row i of ``mask`` from matcher m for each (i, m)
        in ``targets`` (a terminated matcher's row: only its stop tokens); returns mask."""
        self._accept_recorded()
        live: list[tuple[int, Any]] = []
        for i, m in targets:
            if m.is_terminated():  # only its stop tokens remain (e.g. with ignore_eos)
                mask[i] = self._stop_row()
            else:
                live.append((i, m))
        return self._fill_rows(mask, live) if live else mask

    def _accept_recorded(self) -> None:
        """xgrammar accepts the tokens ``advance`` recorded, in one call."""
        recorded, self._accepts = self._accepts, []
        recorded = [a for a in recorded if not a[1].is_terminated()]
        if not recorded:
            return
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m for _, m, _ in recorded],
                                                              [t for _, _, t in recorded])
        for ok, (rid, _, token) in zip(accepted, recorded):
            if not ok:
                logger.warning("request %s: the grammar rejected sampled token %d (every "
                               "allowed token had probability 0?)", rid, token)

    def _fill_rows(self, mask: torch.Tensor, live: list[tuple[int, Any]]) -> torch.Tensor:
        """Fills row i of ``mask`` from matcher m for each (i, m) in ``live``; returns mask."""
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(mask, live[0][0])
            return mask
        threads = min(FILL_THREADS, -(-len(live) // ROWS_PER_FILL_THREAD))
        self._batch_matcher(threads).batch_fill_next_token_bitmask(
            [m for _, m in live], mask, indices=[i for i, _ in live])
        return mask

    def _settle(self) -> None:
        """Waits for the fill in flight (the matchers are the fill thread's until it ends)."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            wait([fill])  # its error, if any, is the model runner's to raise

    def _batch_matcher(self, threads: int) -> Any:
        m = self._batch.get(threads)
        if m is None:
            import xgrammar as xgr

            m = self._batch[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        return m

    def _stop_row(self) -> torch.Tensor:
        if self._stop is None:
            words = [0] * self.words
            for t in self._stop_token_ids:
                if t < self.vocab_size:
                    words[t // 32] |= 1 << (t % 32)
            # as signed int32: bit 31 set is a negative word
            self._stop = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                      dtype=torch.int32)
        return self._stop

    def advance(self, sched: Any, outputs: list[SeqOutput]) -> None:
        """Records the token(s) the step sampled for each guided sequence, before the engine
        applies them (the next step's job accepts them); a request's first step with several
        samples forks its matcher now, before its parent accepts (the output processor forks
        the sequences the same way, child j getting index j)."""
        self._settle()
        if not self._grammars:
            return
        for (group, seq), out in zip(sched.entries, outputs):
            rid = group.request_id
            if not out.samples or seq.is_finished() or rid not in self._grammars:
                continue
            m = self._matcher(rid, seq.index)
            if not group.forked:
                for j, sample in enumerate(out.samples[1:], start=1):
                    child = self._matchers[(rid, j)] = m.fork()
                    self._accepts.append((rid, child, sample.token_id))
            self._accepts.append((rid, m, out.samples[0].token_id))

    def shutdown(self) -> None:
        self._settle()
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=False)
        if self._service is not None:
            self._service.shutdown()
