"""The rejection sampler of speculative decoding: its torch reference (the op table's
``rejection_sample``, contract/ops.py; a backend may register a kernel, and the conformance
suite's pagedllm/testing/test_spec_decode.py checks it, statistically too).

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), per sequence b with
``n_b`` drafts x_1..x_n proposed from distributions q_1..q_n, and the target's distributions
p_1..p_{n+1} at the n + 1 verified positions:

- random rows: draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) (uniform draw
  u_i < p_i(x_i) / q_i(x_i)); at the first rejection the row emits a token drawn from
  norm(max(0, p_i - q_i)) and stops; if every draft is accepted it emits a bonus token drawn
  from p_{n+1}. The emitted tokens are distributed as the target would sample them one by one.
  Drafts proposed deterministically (n-gram, a greedy draft) have q_i = one-hot(x_i)
  (``draft_probs=None``): acceptance with probability p_i(x_i), and the recovered token is drawn
  from p_i with x_i removed.
- greedy rows: draft i is accepted iff it is the argmax of p_i; the row then emits the argmax at
  the first mismatch (or at position n + 1): exactly the tokens greedy decoding would emit.

Draws come in as arguments (``uniform``, ``noise``), made by the caller from each request's own
generator (seeded requests reproduce); a kernel must consume them, never its own randomness.
"""
from __future__ import annotations

import torch

# a position of ``output_token_ids`` past the row's last emitted token
PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     is_greedy: torch.Tensor, uniform: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
    """Verify drafts against the target; returns ``output_token_ids`` [B, K + 1] int64.

    ``target_logits`` [B, K + 1, V] float32: row b's target distribution at verified position i
    is softmax(target_logits[b, i]) (temperature, top-k/p/min-p, penalties and masks already
    applied: -inf entries have probability 0); greedy rows take its argmax. Positions past
    ``num_draft_tokens[b]`` are ignored (any values).
    ``draft_token_ids`` [B, K] int64, ``num_draft_tokens`` [B] int64 in [0, K].
    ``draft_probs`` [B, K, V] float32 (each row sums to 1) or None: deterministic drafts.
    ``is_greedy`` [B] bool. ``uniform`` [B, K] float32 in [0, 1): acceptance draws.
    ``noise`` [B, V] float32 Exp(1) draws: the recovered or bonus token of random rows is
    argmax(weights / noise) over its (unnormalized) distribution (an exponential race).

    Row b of the result holds its accepted drafts, then one recovered or bonus token, then
    PLACEHOLDER_TOKEN_ID: between 1 and num_draft_tokens[b] + 1 tokens.
    """
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    greedy_tokens = target_logits.argmax(dim=-1)  # [B, K + 1]
    pos = torch.arange(k, device=device)
    valid = pos[None, :] < num_draft_tokens[:, None]  # [B, K]
    drafts = draft_token_ids.clamp(min=0)
    rows = torch.arange(b, device=device)
    if bool(is_greedy.all()):  # no distribution needed: the argmax run
        accept = (drafts == greedy_tokens[:, :k]) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        return _emit(draft_token_ids, num_accepted, greedy_tokens[rows, num_accepted], k1)
    probs = torch.softmax(target_logits.float(), dim=-1)  # [B, K + 1, V]
    p_draft = probs[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        accept_random = uniform < p_draft  # q(x) = 1
    else:
        q_draft = draft_probs.gather(2, drafts[..., None]).squeeze(2)
        accept_random = uniform * q_draft < p_draft  # u < p / q, q(x) > 0 for a drawn x
    accept = torch.where(is_greedy[:, None], drafts == greedy_tokens[:, :k], accept_random)
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: the leading run of accepts
    rejected = num_accepted < num_draft_tokens  # else every draft was accepted: bonus token
    p_last = probs[rows, num_accepted]  # [B, V]: p at the first rejection, or at n + 1
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        residual = p_last
    elif draft_probs is None:
        residual = p_last.scatter(1, drafts[rows, at][:, None], 0.0)
    else:
        residual = (p_last - draft_probs[rows, at]).clamp(min=0.0)
    # float rounding can leave nothing of p - q where p == q: then p itself (never rejected in
    # exact arithmetic, so any choice keeps the distribution)
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_last, residual)
    weights = torch.where(rejected[:, None], residual, p_last)
    random_last = (weights / noise).argmax(dim=1)
    last = torch.where(is_greedy, greedy_tokens[rows, num_accepted], random_last)
    return _emit(draft_token_ids, num_accepted, last, k1)


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor,
          k1: int) -> torch.Tensor:
    """[B, K + 1]: each row's first num_accepted drafts, then ``last``, then placeholders."""
    b, device = draft_token_ids.shape[0], draft_token_ids.device
    out = torch.full((b, k1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    keep = torch.arange(k1 - 1, device=device)[None, :] < num_accepted[:, None]
    out[:, :k1 - 1] = torch.where(keep, draft_token_ids, out[:, :k1 - 1])
    out[torch.arange(b, device=device), num_accepted] = last
    return out
