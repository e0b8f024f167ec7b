"""The EAGLE-3 training module (tools/eagle3_head.py) computes what pagedllm's head runs: its
training-time-test steps 0, 1, 2 predict the drafts the engine's proposer makes (step s at
position i plays draft step s + 1), so what training optimises is what drafting does."""
from __future__ import annotations

import os
import sys

import torch

from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.spec_decode.checkpoints import eagle_config, save_eagle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eagle3_head  # noqa: E402
from test_proposers import PROMPT, _draft, _proposer, _Target  # noqa: E402


def test_ttt_steps_are_the_engines_draft_steps(llama_path: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    target_hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    vocab = target_hf.config.vocab_size
    ids = torch.arange(0, vocab, 2)  # every other token: a draft vocabulary of half
    aux = [0, 1, 1]
    torch.manual_seed(0)
    head = eagle3_head.Eagle3Head(target_hf, 96, ids, aux).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    cfg = eagle_config(target_hf.config, 3, intermediate_size=96, draft_vocab_size=len(ids),
                       aux_layer_ids=aux)
    path = save_eagle(str(tmp_path / "e3"), cfg, head.export(vocab))
    target = _Target(llama_path)
    prop = _proposer(target, SpeculativeConfig(model=path, num_speculative_tokens=3))
    first, drafts = _draft(target, prop, 3)
    seq = torch.tensor([PROMPT + [first] + drafts])
    with torch.no_grad():
        out = target_hf(input_ids=seq, output_hidden_states=True)
        states = torch.cat([out.hidden_states[i] for i in aux], dim=-1)[:, :-1]
        steps = head(target_hf.model.embed_tokens(seq[:, 1:]), states, 3)
    n = len(PROMPT)
    trained = [int(ids[steps[s][0, n - 1 + s].argmax()]) for s in range(3)]
    assert trained == drafts
    assert len(set(drafts)) > 1 or drafts[0] != first  # not a degenerate repeat
