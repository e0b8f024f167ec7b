"""Tensor parallelism: each rank's share of an adapter is cut like its base layer (column-parallel:
B's rows, A whole; row-parallel: A's columns, B whole), so the ranks' deltas concatenate (column)
or sum (row, before the all-reduce) to the unsharded delta; and TP=2 through the engine (gloo,
a worker process per rank) gives transformers + PEFT's greedy tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from lora_helpers import DENSE_TARGETS, hf_lora_greedy, lora_prompts, make_adapter
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.lora.peft import read_adapter
from pagedllm.lora.routing import LoRARouter

CASES = {  # name -> (family, config overrides, targets)
    "llama": ("llama", {}, DENSE_TARGETS),  # 2 KV heads: one per rank
    "llama_kv1": ("llama", {"num_key_value_heads": 1}, DENSE_TARGETS),  # KV head replicated
    "phi3": ("phi3", {}, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "gpt2": ("gpt2", {}, ("c_attn", "c_proj", "c_fc")),
    "gpt_neox": ("gpt_neox", {}, ("query_key_value", "dense", "dense_h_to_4h",
                                  "dense_4h_to_h")),
}


def _deltas(router: LoRARouter, adapter, xs: dict, rank: int) -> dict:
    """(module, slice) -> (row-parallel?, this rank's delta for its input: the module's x, or
    its shard of x where the linear is row-parallel)."""
    out = {}
    for module in adapter.modules.values():
        x = xs[module.name]
        for p in router.route(module, adapter.fan_in_fan_out):
            linear = router.linears[p.module]
            if linear.splits_input:
                n = p.a.shape[1]
                x = xs[module.name][:, rank * n:(rank + 1) * n]
            out[(p.module, p.slice_index)] = (linear.splits_input,
                                              (x @ p.a.t() @ p.b.t()) * p.scaling)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_rank_shards_compose_to_the_whole(case: str, checkpoint_factory, tmp_path) -> None:
    family, overrides, targets = CASES[case]
    base = checkpoint_factory(family, **overrides)
    adapter = read_adapter(make_adapter(base, str(tmp_path / "a"), targets=targets, r=8), 16)
    hf_config = AutoConfig.from_pretrained(base)
    gen = torch.Generator().manual_seed(0)
    xs = {name: torch.randn(5, m.a_shape[1], generator=gen)
          for name, m in adapter.modules.items()}
    whole = _deltas(LoRARouter(hf_config), adapter, xs, 0)
    ranks = [_deltas(LoRARouter(hf_config, tp=TPGroup(rank=r, size=2)), adapter, xs, r)
             for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(whole) and whole
    for key, (row, want) in whole.items():
        d0, d1 = ranks[0][key][1], ranks[1][key][1]
        if row:  # partial sums, all-reduced after the expand
            got = d0 + d1
        elif d0.shape == want.shape:  # a replicated KV head: every rank computes it whole
            torch.testing.assert_close(d0, d1)
            got = d0
        else:  # each rank computes its rows of the output
            got = torch.cat([d0, d1], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(key))


@pytest.mark.timeout(600)
def test_tp2_engine_matches_transformers_peft(checkpoint_factory, tmp_path) -> None:
    from pagedllm import LLM, LoRARequest, SamplingParams

    base = checkpoint_factory("llama")
    adapter = make_adapter(base, str(tmp_path / "tp"), r=8, seed=11)
    ps = lora_prompts()[:3]
    want, want_base = hf_lora_greedy(base, adapter, ps, 8), hf_lora_greedy(base, None, ps, 8)
    llm = LLM(base, device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True,
              max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8)
    try:
        req = LoRARequest("tp", 1, adapter)
        assert llm.llm_engine.add_lora(req) and llm.llm_engine.list_loras() == {1}
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps * 2], params, use_tqdm=False,
                            lora_request=[req] * 3 + [None] * 3)
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got == want + want_base
        assert llm.llm_engine.remove_lora(1)
    finally:
        llm.shutdown()


def test_pipeline_stages_route_their_own_layers(checkpoint_factory, tmp_path) -> None:
    """With pipeline parallelism each stage's worker loads the pieces of its own layers only."""
    from pagedllm.distributed.parallel_state import PPGroup

    base = checkpoint_factory("llama", num_hidden_layers=4)
    adapter = read_adapter(make_adapter(base, str(tmp_path / "pp"), r=4), 16)
    hf_config = AutoConfig.from_pretrained(base)
    seen = {}
    for stage in range(2):
        router = LoRARouter(hf_config, pp=PPGroup(rank=stage, size=2))
        pieces = [p for m in adapter.modules.values() for p in router.route(m, False)]
        seen[stage] = {int(p.module.split(".")[1]) for p in pieces}
        assert all(p.module in router.linears for p in pieces)
    assert seen == {0: {0, 1}, 1: {2, 3}}
