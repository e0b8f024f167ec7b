"""Turns logits into tokens on the device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Logprobs are those of the model's distribution (log_softmax of the raw logits). Seeded rows draw
from a generator seeded by (seed, completion index, output length), so a request's tokens depend
only on its own seed and history, never on what else is in the batch or on preemption.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pagedllm.core.batch import Sample
from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling_params import SamplingType
from pagedllm.worker.host_copy import to_device
from pagedllm.worker.logits_controls import ApplyTokenBitmask, apply_logits_controls
from pagedllm.worker.sample_row import SampleRow

_MASK = float("-inf")


@functools.lru_cache(maxsize=None)
def generator_device(device: torch.device) -> torch.device:
    """Where random draws for tensors on ``device`` are made: the device itself, or the host
    for devices without ``torch.Generator`` support (XLA); host draws are then moved over."""
    try:
        torch.Generator(device=device)
        return device
    except RuntimeError:
        return torch.device("cpu")


def _seeded_generator(seed: int, index: int, step: int, device: torch.device) -> torch.Generator:
    mixed = hash((seed, index, step)) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=generator_device(device)).manual_seed(mixed)


def _exponential(shape: tuple[int, ...], generator: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    """Exp(1) draws of ``shape`` from ``generator``, on ``device``."""
    return torch.empty(shape, device=generator.device).exponential_(generator=generator).to(device)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place. Repetition penalty over prompt+output tokens (HF style); presence and frequency
    penalties over output tokens (OpenAI style)."""
    device, vocab = logits.device, logits.shape[1]
    idx = [i for i, r in enumerate(rows) if r.history is not None]
    if not idx:
        return
    width = max(len(rows[i].history) for i in idx)  # type: ignore[arg-type]
    hist = torch.full((len(idx), width), vocab, dtype=torch.int64)
    out_mask = torch.zeros((len(idx), width), dtype=torch.float32)
    for j, i in enumerate(idx):
        h = rows[i].history
        hist[j, :len(h)] = torch.tensor(h, dtype=torch.int64)  # type: ignore[arg-type]
        out_mask[j, rows[i].prompt_len:len(h)] = 1.0  # type: ignore[arg-type]
    hist, out_mask = hist.to(device), out_mask.to(device)
    seen = torch.zeros((len(idx), vocab + 1), device=device)
    seen.scatter_add_(1, hist, torch.ones_like(out_mask))
    counts = torch.zeros((len(idx), vocab + 1), device=device)
    counts.scatter_add_(1, hist, out_mask)
    seen, counts = seen[:, :vocab] > 0, counts[:, :vocab]
    rep = to_device([rows[i].params.repetition_penalty for i in idx], device)[:, None]
    freq = to_device([rows[i].params.frequency_penalty for i in idx], device)[:, None]
    pres = to_device([rows[i].params.presence_penalty for i in idx], device)[:, None]
    sub = logits[idx]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[idx] = sub


def _apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, r in enumerate(rows):
        if r.output_len < r.params.min_tokens and r.params.all_stop_token_ids:
            ids = [t for t in r.params.all_stop_token_ids if t < logits.shape[1]]
            logits[i, ids] = _MASK


def _apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    device = logits.device
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        vocab = logits.shape[1]
        k = to_device([k if k > 0 else vocab for k in top_k], device)
        p = to_device(top_p, device, logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        probs = sorted_logits.softmax(dim=-1)
        drop = (ranks >= k[:, None]) | ((probs.cumsum(dim=-1) - probs) > p[:, None])
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_p = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = to_device(min_p, device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, _MASK)
    return logits


def _top_logprobs_device(logprobs: torch.Tensor, rows_k: list[int | None]
                         ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """The rows asking for logprobs (``want``) and their top ``max k`` (values, ids), on the
    device; (want, None, None) when no row asks for more than the chosen token's."""
    want = [i for i, k in enumerate(rows_k) if k is not None]
    kmax = max((rows_k[i] for i in want), default=0)  # type: ignore[type-var]
    if kmax == 0:
        return want, None, None
    vals, ids = logprobs[to_device(want, logprobs.device)].topk(kmax, dim=-1)
    return want, vals, ids


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy on the host that may still be in flight (pinned, for devices that copy async)."""
    return None if t is None else t.to("cpu", non_blocking=True)


class PendingSamples:
    """A step's draws on their way to the host. ``tokens`` stays on the device (a next step may
    take its inputs from it); ``result()`` waits for the host copies and builds the Samples."""

    def __init__(self, tokens: torch.Tensor, chosen_lp: torch.Tensor, src: list[int],
                 rows_k: list[int | None], top: tuple) -> None:
        self.tokens = tokens  # [num_draws] int64 on the device
        self.src = src  # draw -> row of the logits it came from
        self.rows_k = rows_k
        self.want, top_vals, top_ids = top
        self._host = [_to_host(t) for t in (tokens, chosen_lp, top_vals, top_ids)]
        self._event: torch.Event | None = None
        if tokens.device.type != "cpu":  # the copies above are queued behind the step's work
            try:
                self._event = torch.Event(device=tokens.device)
                self._event.record()
            except RuntimeError:  # no event support: .tolist() in result() waits instead
                self._event = None

    def done(self) -> bool:
        """Whether the step's draws reached the host (without an event: assumed done)."""
        return self._event is None or bool(self._event.query())

    def result(self, num_rows: int) -> list[list[Sample]]:
        if self._event is not None:
            self._event.synchronize()
        tokens, chosen, top_vals, top_ids = (None if t is None else t.tolist() for t in self._host)
        tops: list[PositionLogprobs | None] = [None] * len(self.rows_k)
        for j, i in enumerate(self.want):
            entry = {tokens[i]: chosen[i]}
            k = self.rows_k[i]
            if top_vals is not None and k:
                for t, v in zip(top_ids[j][:k], top_vals[j][:k]):
                    entry.setdefault(t, v)
            tops[i] = entry
        out: list[list[Sample]] = [[] for _ in range(num_rows)]
        for e, i in enumerate(self.src):
            out[i].append(Sample(tokens[e], chosen[e], tops[e]))
        return out


def _plain_greedy(row: SampleRow) -> bool:
    """A row whose draw is its logits' argmax and whose only logprob is the chosen token's."""
    return (row.num_samples == 1 and row.params.sampling_type == SamplingType.GREEDY
            and row.history is None and row.output_len >= row.params.min_tokens
            and not row.params.logprobs)


# logits [rows, vocab] -> (argmax [rows] int64, its logprob [rows] float32)
GreedyLogprobs = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Sampler:
    def __init__(self, device: torch.device, seed: int,
                 greedy_logprobs: GreedyLogprobs | None = None,
                 apply_token_bitmask: ApplyTokenBitmask | None = None) -> None:
        """``greedy_logprobs``: the op for steps whose rows are all plain greedy (the ops table's:
        a torch reference, or a backend's fused kernel); None: every step takes the general
        path below. ``apply_token_bitmask``: the op that masks guided rows (default: the
        ops table's torch reference)."""
        from pagedllm.reference.ops import apply_token_bitmask as reference_bitmask

        self.device = device
        self.generator = torch.Generator(device=generator_device(device)).manual_seed(seed)
        self.greedy_logprobs = greedy_logprobs
        self.apply_token_bitmask = apply_token_bitmask or reference_bitmask

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 bitmask: torch.Tensor | None = None) -> list[list[Sample]]:
        """``logits`` [len(rows), vocab] float32 -> for each row its ``num_samples`` samples."""
        return self.sample_async(logits, rows, bitmask).result(len(rows))

    def sample_async(self, logits: torch.Tensor, rows: list[SampleRow],
                     bitmask: torch.Tensor | None = None) -> PendingSamples:
        """Queues the draws for ``rows``; nothing here waits for the device. ``bitmask``
        [len(rows), ceil(vocab / 32)] int32 on the device: guided decoding's allowed tokens."""
        logits = apply_logits_controls(logits, rows, bitmask, self.apply_token_bitmask)
        if self.greedy_logprobs is not None and all(_plain_greedy(r) for r in rows):
            tokens, chosen_lp = self.greedy_logprobs(logits)
            rows_k = [r.params.logprobs for r in rows]
            want = [i for i, k in enumerate(rows_k) if k is not None]
            return PendingSamples(tokens, chosen_lp, list(range(len(rows))), rows_k,
                                  (want, None, None))
        expanded: list[SampleRow] = []
        src: list[int] = []
        for i, r in enumerate(rows):
            if r.num_samples == 1:
                expanded.append(r)
                src.append(i)
                continue
            for j in range(r.num_samples):
                expanded.append(SampleRow(r.params, 1, r.seq_index + j, r.output_len, r.history,
                                          r.prompt_len))
                src.append(i)
        if len(expanded) != len(rows):
            logits = logits[to_device(src, logits.device)]
        logprobs = torch.log_softmax(logits, dim=-1)
        if any(r.history is not None or r.output_len < r.params.min_tokens for r in expanded):
            logits = logits.clone()  # the edits below are in place; the caller's logits stay
            _apply_penalties(logits, expanded)
            _apply_min_tokens(logits, expanded)
        tokens = self._choose(logits, expanded)
        chosen_lp = logprobs.gather(1, tokens[:, None]).squeeze(1)
        rows_k = [r.params.logprobs for r in expanded]
        return PendingSamples(tokens, chosen_lp, src, rows_k,
                              _top_logprobs_device(logprobs, rows_k))

    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        greedy = [r.params.sampling_type == SamplingType.GREEDY for r in rows]
        tokens = logits.argmax(dim=-1)
        rand = [i for i, g in enumerate(greedy) if not g]
        if not rand:
            return tokens
        sub_rows = [rows[i] for i in rand]
        idx = to_device(rand, logits.device)
        temps = to_device([r.params.temperature for r in sub_rows], logits.device)
        sub = _apply_top_k_top_p_min_p(logits[idx] / temps[:, None], sub_rows)
        probs = sub.softmax(dim=-1)
        # exponential race: argmax(p / q) with q ~ Exp(1) draws from p
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(sub_rows) if r.params.seed is None]
        if unseeded:
            q[to_device(unseeded, probs.device)] = _exponential(
                (len(unseeded), probs.shape[1]), self.generator, probs.device)
        for j, r in enumerate(sub_rows):
            if r.params.seed is not None:
                gen = _seeded_generator(r.params.seed, r.seq_index, r.output_len, probs.device)
                q[j] = _exponential((probs.shape[1],), gen, probs.device)
        tokens[idx] = (probs / q).argmax(dim=-1)
        return tokens
