"""Proposers that run on the workers: a draft model (any registered family sharing the target's
tokenizer) and an EAGLE head (reads the target's hidden states). Both keep a paged KV cache of
their own, indexed by the target's block tables (the same block ids, in tensors of their own):
the block manager allocates once for both, and copy-on-write, swapping and prefix caching act
on both.

Each step the proposer mirrors what the target computed: for every scheduled sequence it runs
the tokens whose KV became final this step (a prompt chunk; for a verification, the last token
and the accepted drafts), plus the token the step sampled, then drafts greedily, one position
per forward. Its KV therefore equals the target's history position for position, and stale
draft-token KV past the accepted run is overwritten by the next step's mirror pass.
"""
from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.contract.attention import AttentionMetadata
from pagedllm.core.batch import ScheduledSeq
from pagedllm.models.layers.linear import LayerContext
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.eagle import AuxHiddenStates
from pagedllm.worker.host_copy import select_rows, to_device
from pagedllm.worker.model_runner import build_metadata

logger = logging.getLogger(__name__)

_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class MirrorSeq:
    """One sequence's share of the step, as a proposer sees it.

    ``tokens`` sit at positions ``[start_pos, start_pos + len(tokens))`` and their KV is final
    (``target_rows``: their rows of the target's hidden states this step); ``new_token`` is the
    token sampled after them (None: a prompt chunk that samples nothing; ``next_token`` is then
    the prompt token after the chunk, when known). ``num_drafts`` > 0: propose that many tokens
    after ``new_token`` (the block table covers their positions).
    """

    seq_id: int
    block_table: list[int]
    start_pos: int
    tokens: list[int]
    target_rows: list[int]
    new_token: int | None = None
    next_token: int | None = None
    num_drafts: int = 0


def _sched(seq_id: int, tokens: list[int], start: int, table: list[int],
           samples: int) -> ScheduledSeq:
    return ScheduledSeq(seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=table,
                        sampling_params=_PARAMS, num_samples=samples)


def _drafts(s: MirrorSeq) -> bool:
    """Whether the proposer drafts after ``s``'s sampled token this step."""
    return s.num_drafts > 0 and s.new_token is not None


class _DraftPasses:
    """The inputs of one propose call's draft passes: one token per drafting sequence, at
    positions that move on by one each pass. The first pass's come from build_metadata; later
    passes change only the slots and lengths (the sequences, their order and block tables, which
    cover the lookahead, stay), so they do not rebuild the rest."""

    def __init__(self, seqs: list[MirrorSeq], block_size: int, device: torch.device) -> None:
        self.seqs = seqs
        self.block_size = block_size
        self.device = device
        self._meta: AttentionMetadata | None = None

    def inputs(self, positions: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [n] int64, metadata) of a pass at ``positions`` (one per sequence)."""
        bs = self.block_size
        if self._meta is None:
            sched = [_sched(s.seq_id, [0], p, s.block_table, 1)
                     for s, p in zip(self.seqs, positions)]
            _, _, meta = build_metadata(sched, bs, self.device)
        else:
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(self.seqs, positions)]
            lens = [p + 1 for p in positions]
            meta = dataclasses.replace(
                self._meta, slot_mapping=to_device(slots, self.device, torch.int64),
                decode_seq_lens=to_device(lens, self.device, torch.int32),
                max_decode_seq_len=max(lens), decode_seq_lens_list=lens, extras={})
        self._meta = meta
        return to_device(positions, self.device, torch.int64), meta


def _layout(seqs: list[ScheduledSeq]) -> list[int]:
    """Batch order build_metadata needs (multi-token chunks first): indices into ``seqs``."""
    return sorted(range(len(seqs)), key=lambda i: 0 if seqs[i].num_tokens > 1 else 1)


class DeviceProposer(ABC):
    """A proposer with a model and KV cache on the worker's device."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.host_caches: list[torch.Tensor] = []
        # cumulative, for tests: forwards run and drafts made
        self.num_forwards = 0

    @abstractmethod
    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache shape for ``num_blocks`` blocks (the attention's layout)."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    def block_bytes(self, itemsize: int) -> int:
        """Bytes one block takes in this proposer's caches (all its layers)."""
        n = 1
        for d in self.kv_layer_shape(1):
            n *= d
        return n * itemsize * self.num_layers

    @abstractmethod
    def propose(self, seqs: list[MirrorSeq], target_hidden: torch.Tensor | None
                ) -> dict[int, list[int]]:
        """Mirror the step and draft: seq_id -> drafts for sequences with num_drafts > 0."""

    def forget(self, seq_ids: list[int]) -> None:
        """These sequences finished: drop what the proposer kept about them."""

    # --- shared driving loop ---------------------------------------------------------------
    def _run(self, seqs: list[MirrorSeq], first: Any, step: Any) -> dict[int, list[int]]:
        """``first(inputs) -> (greedy tokens of the drafting rows, state)`` runs the mirror
        pass; ``step(tokens, positions, state, passes) -> (tokens, state)`` one draft position
        for each drafting sequence (``passes``: their inputs). Greedy drafts (q = one-hot)."""
        drafting = [s for s in seqs if _drafts(s)]
        if not seqs:
            return {}
        tokens, state = first(seqs)  # [len(drafting)] on the device
        self.num_forwards += 1
        if not drafting:
            return {}
        drafts = [tokens]
        want = max(s.num_drafts for s in drafting)
        pos = [s.start_pos + len(s.tokens) for s in drafting]  # the new token's position
        passes = _DraftPasses(drafting, self.block_size, self.device)
        for i in range(1, want):
            tokens, state = step(tokens, [p + i for p in pos], state, passes)
            self.num_forwards += 1
            drafts.append(tokens)
        table = torch.stack(drafts, dim=1).tolist()  # [len(drafting), want]
        return {s.seq_id: table[j][:s.num_drafts] for j, s in enumerate(drafting)}


class DraftModelProposer(DeviceProposer):
    """A smaller model of any registered family: ``LLM(target, speculative_config={"model":
    DRAFT, "num_speculative_tokens": k})``."""

    def __init__(self, model: nn.Module, hf_config: Any, ctx: LayerContext,
                 block_size: int) -> None:
        super().__init__(ctx.device, block_size)
        self.model = model
        self.hf_config = hf_config
        self.attn_cls = ctx.attn_cls
        heads = int(hf_config.num_attention_heads)
        # this rank's KV heads (tensor parallel: split, or one replicated head)
        self.kv_heads = max(1, int(getattr(hf_config, "num_key_value_heads", None) or heads)
                            // ctx.tp.size)
        self.head_size = int(getattr(hf_config, "head_dim", None)
                             or hf_config.hidden_size // heads)
        self._layers = int(hf_config.num_hidden_layers)

    @property
    def num_layers(self) -> int:
        return self._layers

    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.attn_cls.kv_cache_shape(num_blocks, self.block_size, self.kv_heads,
                                            self.head_size)

    def propose(self, seqs: list[MirrorSeq], target_hidden: torch.Tensor | None
                ) -> dict[int, list[int]]:
        return self._run(seqs, self._mirror, self._step)

    def _forward(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Runs ``batch`` (any order); returns (hidden [T, H], each sequence's last row)."""
        order = _layout(batch)
        ordered = [batch[i] for i in order]
        ids, positions, meta = build_metadata(ordered, self.block_size, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(positions, device=self.device), self.kv_caches, meta)
        last, at = [0] * len(batch), 0
        for i, s in zip(order, ordered):
            at += s.num_tokens
            last[i] = at - 1
        return hidden, last

    def _mirror(self, seqs: list[MirrorSeq]) -> tuple[torch.Tensor, Any]:
        # the sampled token is run only where drafting follows (its slot is reserved then);
        # otherwise it runs as the first token of the sequence's next chunk
        batch = [_sched(s.seq_id, s.tokens + ([s.new_token] if _drafts(s) else []),
                        s.start_pos, s.block_table, 1) for s in seqs]
        hidden, last = self._forward(batch)
        rows = [last[i] for i, s in enumerate(seqs) if _drafts(s)]
        if not rows:
            return hidden[:0], None
        return self._greedy(hidden[torch.tensor(rows, device=self.device)]), None

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _step(self, tokens: torch.Tensor, positions: list[int], state: Any,
              passes: _DraftPasses) -> tuple[torch.Tensor, Any]:
        pos, meta = passes.inputs(positions)
        hidden = self.model(tokens, pos, self.kv_caches, meta)  # one row per sequence, in order
        return self._greedy(hidden), None


class EagleProposer(DeviceProposer):
    """An EAGLE-1 or EAGLE-3 head (spec_decode/eagle.py) over the target's hidden states:
    ``speculative_config={"method": "eagle", "model": HEAD, "num_speculative_tokens": k}``."""

    def __init__(self, head: nn.Module, target: nn.Module, ctx: LayerContext,
                 block_size: int) -> None:
        super().__init__(ctx.device, block_size)
        self.head = head
        self.target = target
        self.attn_cls = ctx.attn_cls
        self.kv_heads = max(1, head.num_kv_heads // ctx.tp.size)  # this rank's
        # EAGLE-3: the residual stream entering some of the target's layers (hooks on this
        # pipeline stage's; earlier stages' arrive with its intermediate tensors)
        self.aux_states = (AuxHiddenStates(target, head.aux_layers(len(target.layers)))
                           if head.version == 3 and head.use_aux else None)
        # seq_id -> (position, feature [1, H]) of a prompt chunk's last position, whose next
        # token arrives with the next chunk
        self._held: dict[int, tuple[int, torch.Tensor]] = {}

    @property
    def num_layers(self) -> int:
        return self.head.num_layers

    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.attn_cls.kv_cache_shape(num_blocks, self.block_size, self.kv_heads,
                                            self.head.head_size)

    def begin_target_forward(self) -> None:
        """Called before the target's forward: the hooks collect this step's states."""
        if self.aux_states is not None:
            self.aux_states.begin()

    def target_features(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] the head's hidden input for the target's rows: the final hidden states
        (EAGLE-1), or the fused auxiliary states (EAGLE-3)."""
        if self.aux_states is not None:
            return self.head.combine(self.aux_states.features())
        return final_hidden

    def _greedy(self, out: torch.Tensor) -> torch.Tensor:
        """[T] greedy draft tokens (target ids) of the head's outputs."""
        if self.head.version == 3:
            return self.head.greedy(out)
        return self.target.compute_logits(out).argmax(dim=-1)

    def propose(self, seqs: list[MirrorSeq], target_hidden: torch.Tensor | None
                ) -> dict[int, list[int]]:
        assert target_hidden is not None
        features = self.target_features(target_hidden)
        return self._run(seqs, lambda s: self._mirror(s, features), self._step)

    def _forward(self, batch: list[ScheduledSeq], hidden_rows: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(for-logits [T, H], fed-back [T, H], each sequence's last row) of the head over
        ``batch`` whose hidden inputs are ``hidden_rows`` (one tensor per sequence)."""
        order = _layout(batch)
        ordered = [batch[i] for i in order]
        ids, positions, meta = build_metadata(ordered, self.block_size, self.device)
        hidden = torch.cat([hidden_rows[i] for i in order])
        out, feed = self.head(torch.tensor(ids, device=self.device),
                              torch.tensor(positions, device=self.device), hidden,
                              self.target.embed_tokens, self.kv_caches, meta)
        last, at = [0] * len(batch), 0
        for i, s in zip(order, ordered):
            at += s.num_tokens
            last[i] = at - 1
        return out, feed, last

    def _mirror(self, seqs: list[MirrorSeq], features: torch.Tensor
                ) -> tuple[torch.Tensor, Any]:
        """Head position i reads (token at i + 1, target feature at i): every final position
        whose next token is known. A prompt chunk's last position waits for the next chunk's
        first token (its feature is kept until then)."""
        batch, rows, kept = [], [], []
        for s in seqs:
            following = s.tokens[1:] + ([s.new_token] if s.new_token is not None else
                                        [s.next_token] if s.next_token is not None else [])
            start = s.start_pos
            feats = select_rows(features, s.target_rows[:len(following)])
            held = self._held.pop(s.seq_id, None)
            if held is not None and held[0] == s.start_pos - 1:  # the previous chunk's last
                following = [s.tokens[0]] + following
                feats = torch.cat([held[1], feats])
                start -= 1
            if s.new_token is None and s.next_token is None:
                self._held[s.seq_id] = (s.start_pos + len(s.tokens) - 1,
                                        features[s.target_rows[-1]:s.target_rows[-1] + 1].clone())
            if not following:
                continue
            batch.append(_sched(s.seq_id, following, start, s.block_table, 1))
            rows.append(feats)
            kept.append(s)
        if not batch:
            return features[:0], None
        out, feed, last = self._forward(batch, rows)
        pick = [last[j] for j, s in enumerate(kept) if _drafts(s)]
        if not pick:
            return features[:0], None
        idx = torch.tensor(pick, device=self.device)
        return self._greedy(out[idx]), feed[idx]

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)

    def _step(self, tokens: torch.Tensor, positions: list[int], state: torch.Tensor,
              passes: _DraftPasses) -> tuple[torch.Tensor, Any]:
        """One draft position: (draft token, the head's own previous output) at each drafting
        sequence's next position (one before the drafted token's); one row per sequence, in
        the drafting order."""
        pos, meta = passes.inputs([p - 1 for p in positions])
        out, feed = self.head(tokens, pos, state, self.target.embed_tokens, self.kv_caches, meta)
        return self._greedy(out), feed
