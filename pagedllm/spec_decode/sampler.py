"""Verification sampling: the target's logits at a sequence's k + 1 verified positions, the
drafts, and each request's own random draws -> the tokens the sequence emits this step.

Each verified position is processed exactly as the plain sampler processes a decode row
(worker/sampler.py: logits controls, penalties and min_tokens over the history including the
drafts before it, then temperature and top-k/top-p/min-p for random rows), so a greedy row
emits the tokens plain greedy decoding would, and a random row's tokens follow the target's
distribution. The accept/reject decision is the ops table's ``rejection_sample`` op.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.core.batch import Sample
from pagedllm.reference.rejection import PLACEHOLDER_TOKEN_ID
from pagedllm.outputs import PositionLogprobs
from pagedllm.sampling_params import SamplingType
from pagedllm.worker.host_copy import to_device
from pagedllm.worker.logits_controls import apply_logits_controls
from pagedllm.worker.sampler import (Sampler, SampleRow, _apply_min_tokens, _apply_penalties,
                                     _apply_top_k_top_p_min_p, _plain_greedy, _seeded_generator,
                                     generator_device)


@dataclass
class VerifyRow:
    """One sequence under verification: its plain decode row (``row.output_len``: outputs
    before this step) and the drafts scored at the positions after it."""

    row: SampleRow
    drafts: list[int]
    # [len(drafts), vocab] float32 on the device: the distributions the drafts were drawn from;
    # None: drawn deterministically (q = one-hot)
    draft_probs: torch.Tensor | None = None


def position_rows(v: VerifyRow) -> list[SampleRow]:
    """The plain sampler's row for each of the k + 1 verified positions: position i follows the
    first i drafts (output length and, where penalties need it, history include them)."""
    r = v.row
    return [SampleRow(r.params, 1, r.seq_index, r.output_len + i,
                      None if r.history is None else r.history + v.drafts[:i], r.prompt_len)
            for i in range(len(v.drafts) + 1)]


def _draws(rows: list[SampleRow], k: int, vocab: int, generator: torch.Generator,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform [B, K], noise [B, V] Exp(1)) on ``device``: a seeded request's from its own
    generator (seed, completion index, output length), the others' from ``generator``."""
    if all(r.params.sampling_type == SamplingType.GREEDY for r in rows):  # draws unused
        return (torch.zeros((len(rows), k), device=device),
                torch.ones((len(rows), vocab), device=device))
    gdev = generator_device(device)
    uniform = torch.empty((len(rows), k), device=gdev)
    noise = torch.empty((len(rows), vocab), device=gdev)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=gdev)
        uniform[idx] = torch.rand((len(unseeded), k), generator=generator, device=gdev)
        noise[idx] = torch.empty((len(unseeded), vocab), device=gdev).exponential_(
            generator=generator)
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            gen = _seeded_generator(r.params.seed, r.seq_index, r.output_len, device)
            uniform[i] = torch.rand((k,), generator=gen, device=gdev)
            noise[i] = torch.empty((vocab,), device=gdev).exponential_(generator=gen)
    return uniform.to(device), noise.to(device)


class VerifySampler:
    """Runs verification for a batch of ``VerifyRow``s; shares the plain sampler's generator and
    bitmask op, and calls the ops table's ``rejection_sample``."""

    def __init__(self, sampler: Sampler, rejection_sample: Callable[..., torch.Tensor]) -> None:
        self.sampler = sampler
        self.rejection_sample = rejection_sample

    def target_logits(self, logits: torch.Tensor, rows: list[SampleRow]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(processed logits, logprobs), both [len(rows), vocab]: the logits whose softmax is the
        target distribution (random rows) or whose argmax is the greedy token, and the logprobs
        a request sees (log_softmax after its logits controls, as the plain sampler reports)."""
        logits = apply_logits_controls(logits, rows, None, self.sampler.apply_token_bitmask)
        logprobs = torch.log_softmax(logits, dim=-1)
        if any(r.history is not None or r.output_len < r.params.min_tokens for r in rows):
            logits = logits.clone()
            _apply_penalties(logits, rows)
            _apply_min_tokens(logits, rows)
        rand = [i for i, r in enumerate(rows) if r.params.sampling_type != SamplingType.GREEDY]
        if rand:
            logits = logits.clone()
            idx = to_device(rand, logits.device)
            sub = [rows[i] for i in rand]
            temps = to_device([r.params.temperature for r in sub], logits.device)
            logits[idx] = _apply_top_k_top_p_min_p(logits[idx] / temps[:, None], sub)
        return logits, logprobs

    def __call__(self, logits: torch.Tensor, verify: list[VerifyRow]) -> list[list[Sample]]:
        """``logits`` [sum(len(drafts) + 1), vocab] float32: each row's verified positions back
        to back, in ``verify`` order -> the tokens each row emits (1 to len(drafts) + 1)."""
        if not verify:
            return []
        if self.sampler.greedy_logprobs is not None and all(_plain_greedy(v.row) for v in verify):
            return self._greedy(logits, verify)
        device, vocab = logits.device, logits.shape[1]
        expanded = [p for v in verify for p in position_rows(v)]
        processed, logprobs = self.target_logits(logits, expanded)
        b, k = len(verify), max(len(v.drafts) for v in verify)
        # the padded [B, K + 1] layout: flat row of (b, i), or the row's last for padding
        index, start = [], 0
        for v in verify:
            n = len(v.drafts)
            index.extend(start + min(i, n) for i in range(k + 1))
            start += n + 1
        flat = to_device(index, device, torch.int64)
        target = processed[flat].view(b, k + 1, vocab)
        drafts = to_device([v.drafts + [0] * (k - len(v.drafts)) for v in verify], device,
                           torch.int64).view(b, k)
        num_drafts = to_device([len(v.drafts) for v in verify], device, torch.int64)
        greedy = to_device([v.row.params.sampling_type == SamplingType.GREEDY for v in verify],
                           device, torch.bool)
        draft_probs = self._draft_probs(verify, k, vocab, device)
        base_rows = [v.row for v in verify]
        uniform, noise = _draws(base_rows, k, vocab, self.sampler.generator, device)
        out = self.rejection_sample(target, drafts, num_drafts, draft_probs, greedy, uniform,
                                    noise)  # [B, K + 1]
        lp = logprobs[flat].view(b, k + 1, vocab)
        chosen = lp.gather(2, out.clamp(min=0)[..., None]).squeeze(2)  # [B, K + 1]
        tops = self._top_logprobs(lp, verify)
        tokens, chosen_h = out.tolist(), chosen.tolist()
        result: list[list[Sample]] = []
        for j, v in enumerate(verify):
            samples = []
            for i, t in enumerate(tokens[j]):
                if t == PLACEHOLDER_TOKEN_ID:
                    break
                top: PositionLogprobs | None = None
                if v.row.params.logprobs is not None:
                    top = {t: chosen_h[j][i]}
                    if tops is not None and v.row.params.logprobs:
                        ids, vals = tops
                        for tok, val in zip(ids[j][i][:v.row.params.logprobs],
                                            vals[j][i][:v.row.params.logprobs]):
                            top.setdefault(tok, val)
                samples.append(Sample(t, chosen_h[j][i], top))
            result.append(samples)
        return result

    def _greedy(self, logits: torch.Tensor, verify: list[VerifyRow]) -> list[list[Sample]]:
        """Every row plain greedy (no penalties, min_tokens reached, at most the chosen token's
        logprob): what rejection sampling decides for a greedy target, from the plain
        sampler's op (one argmax + logprob kernel, one read back): a sequence emits the
        target's argmax at each position up to and including the first that differs from
        its draft (all k + 1 when every draft matches). Draft distributions play no part."""
        expanded = [p for v in verify for p in position_rows(v)]
        logits = apply_logits_controls(logits, expanded, None, self.sampler.apply_token_bitmask)
        assert self.sampler.greedy_logprobs is not None
        tokens_d, chosen_d = self.sampler.greedy_logprobs(logits)
        tokens, chosen = tokens_d.tolist(), chosen_d.tolist()
        result: list[list[Sample]] = []
        at = 0
        for v in verify:
            samples = []
            for i in range(len(v.drafts) + 1):
                t, lp = tokens[at + i], chosen[at + i]
                samples.append(Sample(t, lp, None if v.row.params.logprobs is None else {t: lp}))
                if i == len(v.drafts) or t != v.drafts[i]:
                    break
            at += len(v.drafts) + 1
            result.append(samples)
        return result

    @staticmethod
    def _draft_probs(verify: list[VerifyRow], k: int, vocab: int,
                     device: torch.device) -> torch.Tensor | None:
        """[B, K, V]: each row's draft distributions (one-hot where drafted deterministically),
        or None when every row drafted deterministically."""
        if all(v.draft_probs is None for v in verify):
            return None
        # rows' distributions all on the host: assembled there and moved once (one transfer,
        # not one device op per row: a lazy device such as XLA would trace thousands)
        host = all(v.draft_probs is None or v.draft_probs.device.type == "cpu" for v in verify)
        build = torch.device("cpu") if host else device
        q = torch.zeros((len(verify), k, vocab), device=build)
        for j, v in enumerate(verify):
            n = len(v.drafts)
            if v.draft_probs is not None:
                q[j, :n] = v.draft_probs[:n]
            elif n:
                q[j, torch.arange(n, device=build), to_device(v.drafts, build, torch.int64)] = 1
        return q.to(device)

    @staticmethod
    def _top_logprobs(lp: torch.Tensor, verify: list[VerifyRow]
                      ) -> tuple[list, list] | None:
        kmax = max((v.row.params.logprobs or 0) for v in verify)
        if kmax == 0:
            return None
        vals, ids = lp.topk(kmax, dim=-1)
        return ids.tolist(), vals.tolist()
