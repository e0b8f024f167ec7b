"""Proposers against independent references: n-gram lookup; the draft model's greedy drafts
(equal to transformers' greedy continuation when the draft is the target); EAGLE-1 and EAGLE-3
heads in vLLM's checkpoint formats against a plain-torch re-computation of the head over the
whole sequence (transformers' Llama layers), including a draft vocabulary mapped by d2t."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backends.registry import resolve_backend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.ops import Ops
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.spec_decode.checkpoints import eagle_config, random_eagle_state, save_eagle
from pagedllm.spec_decode.loading import build_proposer, resolve_method
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.proposer import MirrorSeq
from pagedllm.worker.model_runner import build_metadata

BLOCK = 4
PROMPT = [5, 17, 99, 3, 42, 8, 8, 11, 250, 31, 64]


def test_ngram_lookup() -> None:
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    assert propose_ngram(toks, 2, 1, 3) == [7, 7]  # the latest earlier "1 2 3" -> 7 7
    assert propose_ngram(toks, 5, 4, 4) == []  # no earlier 4-gram match
    assert propose_ngram([4, 5, 4, 5, 4], 3, 1, 2) == [5, 4]  # overlapping continuation
    assert propose_ngram([1, 2], 3, 1, 2) == []
    assert propose_ngram([3, 3], 3, 1, 1) == [3]


class _Target:
    """The target model loaded by pagedllm's loader on cpu, with a cache of its own."""

    def __init__(self, path: str) -> None:
        config = EngineArgs(model=path, dtype="float32").create_engine_config()
        backend = resolve_backend("cpu")
        config.device = "cpu"
        backend.check_and_update_config(config)
        self.config, self.device = config, torch.device("cpu")
        attn_cls = backend.attention_cls(config)
        self.ctx = LayerContext(ops=Ops(), tp=_tp(), dtype=torch.float32, device=self.device,
                                attn_cls=attn_cls)
        from pagedllm.models.loader import load_model

        self.model = load_model(config.model, self.ctx)
        m = config.model
        shape = attn_cls.kv_cache_shape(64, BLOCK, m.get_num_kv_heads(), m.get_head_size())
        self.caches = [torch.zeros(shape) for _ in range(m.get_num_layers())]

    def prefill(self, tokens: list[int], table: list[int]) -> tuple[torch.Tensor, int]:
        """(final hidden states [T, H], greedy next token) of a prompt."""
        from pagedllm.core.batch import ScheduledSeq
        from pagedllm.sampling_params import SamplingParams

        seq = ScheduledSeq(seq_id=0, token_ids=tokens, start_pos=0, block_table=table,
                           sampling_params=SamplingParams(), num_samples=1)
        ids, pos, meta = build_metadata([seq], BLOCK, self.device)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
            return hidden, int(self.model.compute_logits(hidden[-1:]).argmax())


def _tp():  # noqa: ANN202
    from pagedllm.distributed.parallel_state import TPGroup

    return TPGroup()


def _proposer(target: _Target, spec: SpeculativeConfig):  # noqa: ANN202
    spec.method = resolve_method(spec)
    prop = build_proposer(spec, target.config, target.model, target.ctx)
    prop.kv_caches = [torch.zeros(prop.kv_layer_shape(64)) for _ in range(prop.num_layers)]
    return prop


def _draft(target: _Target, prop, k: int) -> tuple[int, list[int]]:  # noqa: ANN001
    table = list(range(8))
    if hasattr(prop, "begin_target_forward"):
        prop.begin_target_forward()
    hidden, first = target.prefill(PROMPT, table)
    with torch.inference_mode():
        out = prop.propose([MirrorSeq(0, table, 0, PROMPT, list(range(len(PROMPT))),
                                      new_token=first, num_drafts=k)], hidden)
    return first, out[0]


def test_draft_model_equal_to_target_drafts_its_greedy_continuation(llama_path: str) -> None:
    from transformers import AutoModelForCausalLM

    target = _Target(llama_path)
    prop = _proposer(target, SpeculativeConfig(model=llama_path, num_speculative_tokens=4))
    first, drafts = _draft(target, prop, 4)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False)[0].tolist()
    assert [first] + drafts == ref[len(PROMPT):]
    assert prop.num_forwards == 4  # one mirror pass, then one forward per further draft


# --- EAGLE references ----------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _target_states(path: str, tokens: list[int]) -> tuple[nn.Module, list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    # hidden_states[i]: the residual stream entering layer i; the last: after the final norm
    return hf, [h[0] for h in out.hidden_states]


def _eagle1_reference(path: str, head_dir: str, state: dict, tokens: list[int], first: int,
                      k: int) -> list[int]:
    """The head over the whole sequence each step, with transformers' Llama layers."""
    from transformers import AutoConfig, LlamaModel

    hf, states = _target_states(path, tokens)
    feats = states[-1]  # the target's final hidden states
    cfg = AutoConfig.from_pretrained(head_dir)
    layers = LlamaModel(cfg).float().eval()
    layers.load_state_dict({k2: v for k2, v in state.items() if k2.startswith("layers.")},
                           strict=False)
    layers.layers[0].input_layernorm = nn.Identity()
    layers.norm = nn.Identity()
    embed, lm_head = hf.model.embed_tokens, hf.lm_head
    fc_w, fc_b = state["fc.weight"], state.get("fc.bias")
    seq_tokens = tokens[1:] + [first]  # position i reads the token at i + 1
    hidden = list(feats)
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            x = F.linear(torch.cat([embed(torch.tensor(seq_tokens)), torch.stack(hidden)], -1),
                         fc_w, fc_b)
            out = layers(inputs_embeds=x[None]).last_hidden_state[0]
            d = int(lm_head(out[-1]).argmax())
            drafts.append(d)
            seq_tokens.append(d)
            hidden.append(out[-1])
    return drafts


def _eagle3_reference(path: str, cfg: dict, state: dict, tokens: list[int], first: int,
                      k: int) -> list[int]:
    """EAGLE-3's layer written out in torch: normed embedding beside the normed hidden state,
    attention from [2H], the fc-fused auxiliary target states, the draft vocabulary via d2t."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf, states = _target_states(path, tokens)
    aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    feats = F.linear(torch.cat([states[i] for i in aux], -1), state["fc.weight"])
    eps, d, q, kv = cfg["rms_norm_eps"], cfg["head_dim"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k2: v for k2, v in cfg.items()
                                               if k2 not in ("architectures", "eagle_config")}))
    p = "midlayer."
    vocab, draft_vocab = cfg["vocab_size"], cfg["draft_vocab_size"]
    ids = torch.arange(draft_vocab) + state.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    def layer(toks: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(toks)
        emb = _rms(hf.model.embed_tokens(torch.tensor(toks)), state[p + "input_layernorm.weight"],
                   eps)
        x = torch.cat([emb, _rms(hidden, state[p + "hidden_norm.weight"], eps)], -1)
        qs = F.linear(x, state[p + "self_attn.q_proj.weight"]).view(n, q, d).transpose(0, 1)
        ks = F.linear(x, state[p + "self_attn.k_proj.weight"]).view(n, kv, d).transpose(0, 1)
        vs = F.linear(x, state[p + "self_attn.v_proj.weight"]).view(n, kv, d).transpose(0, 1)
        cos, sin = rope(x[None], torch.arange(n)[None])
        cos, sin = cos[0][None], sin[0][None]

        def rot(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)

        qs, ks = qs * cos + rot(qs) * sin, ks * cos + rot(ks) * sin
        ks, vs = ks.repeat_interleave(q // kv, 0), vs.repeat_interleave(q // kv, 0)
        att = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True)[0]
        h = F.linear(att.transpose(0, 1).reshape(n, q * d), state[p + "self_attn.o_proj.weight"])
        h = h + hidden
        m = _rms(h, state[p + "post_attention_layernorm.weight"], eps)
        m = F.linear(F.silu(F.linear(m, state[p + "mlp.gate_proj.weight"]))
                     * F.linear(m, state[p + "mlp.up_proj.weight"]), state[p + "mlp.down_proj.weight"])
        out = m + h
        return _rms(out, state["norm.weight"], eps), out

    seq_tokens = tokens[1:] + [first]
    hidden = feats
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            normed, out = layer(seq_tokens, hidden)
            logits = torch.full((vocab,), float("-inf"))
            logits[ids] = F.linear(normed[-1], state["lm_head.weight"])
            dr = int(logits.argmax())
            drafts.append(dr)
            seq_tokens.append(dr)
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


@pytest.mark.parametrize("fc_bias,layers", [(False, 1), (True, 2)])
def test_eagle1_head_matches_reference(llama_path: str, tmp_path, fc_bias: bool,
                                       layers: int) -> None:
    from transformers import AutoConfig

    cfg = eagle_config(AutoConfig.from_pretrained(llama_path), 1, num_layers=layers)
    state = random_eagle_state(cfg, 1, std=0.2, fc_bias=fc_bias, seed=3)
    head_dir = save_eagle(str(tmp_path / "eagle1"), cfg, state)
    target = _Target(llama_path)
    spec = SpeculativeConfig(model=head_dir, num_speculative_tokens=4)
    prop = _proposer(target, spec)
    assert spec.method == "eagle"
    first, drafts = _draft(target, prop, 4)
    assert drafts == _eagle1_reference(llama_path, head_dir, state, PROMPT, first, 4)


def test_eagle3_head_matches_reference(llama_path: str, tmp_path) -> None:
    from transformers import AutoConfig

    cfg = eagle_config(AutoConfig.from_pretrained(llama_path), 3, draft_vocab_size=64,
                       aux_layer_ids=[0, 1, 1])
    state = random_eagle_state(cfg, 3, std=0.2, seed=4)
    head_dir = save_eagle(str(tmp_path / "eagle3"), cfg, state)
    target = _Target(llama_path)
    spec = SpeculativeConfig(model=head_dir, num_speculative_tokens=3)
    prop = _proposer(target, spec)
    assert spec.method == "eagle3"
    first, drafts = _draft(target, prop, 3)
    assert drafts == _eagle3_reference(llama_path, cfg, state, PROMPT, first, 3)
    assert all(t % (cfg["vocab_size"] // 64) == 0 for t in drafts)  # only draft-vocab tokens
