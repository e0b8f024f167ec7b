"""Rope scaling read from the HF config (linear, dynamic NTK, yarn, llama3, longrope): the cos/sin
tables equal transformers' rotary embedding per step (prefill and decode, before and after the
length where dynamic / longrope switch), and Llama checkpoints using them equal transformers'
greedy tokens."""
from __future__ import annotations

import types

import pytest
import torch
from family_utils import assert_greedy_matches, hf_greedy, prompts

from pagedllm.models.layers.rotary import RotaryEmbedding, rotary_dim_of

HEAD = 16
SCALINGS: dict[str, dict] = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=32,
                     short_factor=[1.0 + 0.1 * i for i in range(HEAD // 2)],
                     long_factor=[1.5 + 0.3 * i for i in range(HEAD // 2)]),
}


def _config(name: str, mpe: int = 64) -> object:
    import transformers as tf

    return tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=mpe, intermediate_size=64, num_hidden_layers=1,
                          vocab_size=259,
                          rope_parameters=dict(SCALINGS[name], rope_theta=10000.0))


def _prefill_metadata(length: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_prefills=1, prefill_seq_lens_list=[length],
                                 prefill_query_lens_list=[length], num_decode_tokens=0,
                                 decode_seq_lens_list=[])


def _decode_metadata(lengths: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_prefills=0, prefill_seq_lens_list=[],
                                 prefill_query_lens_list=[], num_decode_tokens=len(lengths),
                                 decode_seq_lens_list=lengths)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [20, 50, 90])  # below and above 32 (longrope) and 64 (dynamic)
def test_tables_equal_transformers(name: str, length: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config(name)
    ours = RotaryEmbedding(config, HEAD, 256, torch.float32, torch.device("cpu"))
    x = torch.zeros(1, length, HEAD)
    # prefill of ``length`` tokens: transformers' one forward over the whole prompt
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, torch.arange(length)[None])
    cos, sin = ours(torch.arange(length), _prefill_metadata(length))
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    # one decode step at position length - 1 of two sequences, in one batch with another one
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x[:, :1], torch.tensor([[length - 1]]))
    cos, sin = ours(torch.tensor([length - 1, 3]), _decode_metadata([length, 4]))
    torch.testing.assert_close(cos[:1], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:1], hf_sin[0], rtol=0, atol=1e-6)
    short_cos, _ = LlamaRotaryEmbedding(config)(x[:, :1], torch.tensor([[3]]))
    torch.testing.assert_close(cos[1:], short_cos[0], rtol=0, atol=1e-6)


def test_unknown_rope_type_is_named() -> None:
    config = _config("linear")
    config.rope_parameters = dict(rope_type="wobbly", rope_theta=10000.0)
    with pytest.raises(ValueError, match="rope_type='wobbly'.*llama3"):
        RotaryEmbedding(config, HEAD, 16, torch.float32, torch.device("cpu"))


def test_partial_rotary_dim() -> None:
    import transformers as tf

    assert rotary_dim_of(tf.GPTNeoXConfig(hidden_size=64, num_attention_heads=4,
                                          rotary_pct=0.25), 16) == 4
    assert rotary_dim_of(tf.Phi3Config(partial_rotary_factor=0.5), 96) == 48
    assert rotary_dim_of(_config("linear"), HEAD) == HEAD


@pytest.mark.parametrize("name", ["llama3", "linear", "yarn"])
def test_llama_checkpoint_with_rope_scaling(name: str, tmp_path) -> None:
    """Llama 3.1/3.2-style llama3 scaling and the static scalings, end to end (the prompts and
    their continuations pass original_max_position_embeddings=32)."""
    from pagedllm.testing.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path), "llama",
                           rope_parameters=dict(SCALINGS[name], rope_theta=10000.0))
    expected = hf_greedy(path, prompts())
    assert_greedy_matches(path, "plain", expected)
    assert_greedy_matches(path, "chunked_prefill", expected)


def test_sequence_lengths_from_tensors_without_host_lists() -> None:
    """Metadata whose host-side lists are empty (a backend that only fills the tensors): the
    lengths come from query_start_loc / prefill_seq_lens / decode_seq_lens instead."""
    from pagedllm.models.layers.rotary import step_seq_lens

    meta = types.SimpleNamespace(
        num_prefills=2, num_decode_tokens=1, prefill_seq_lens_list=[], prefill_query_lens_list=[],
        decode_seq_lens_list=[], prefill_seq_lens=torch.tensor([40, 3]),
        query_start_loc=torch.tensor([0, 2, 5]), decode_seq_lens=torch.tensor([90]))
    positions = torch.tensor([38, 39, 0, 1, 2, 89, 0])  # the last row is bucket padding
    assert step_seq_lens(positions, meta).tolist() == [40, 40, 3, 3, 3, 90, 1]


def test_scaled_model_length() -> None:
    """Linear, dynamic and yarn scaling lengthen the model (vLLM's rule); llama3, longrope and
    plain rope keep max_position_embeddings."""
    from pagedllm.engine.arg_utils import derive_max_model_len

    assert derive_max_model_len(_config("dynamic"), None) == 128  # 64 * 2
    assert derive_max_model_len(_config("linear"), None) == 128
    assert derive_max_model_len(_config("yarn"), None) == 128  # original 32 * 4
    assert derive_max_model_len(_config("llama3"), None) == 64
    assert derive_max_model_len(_config("longrope"), None) == 64
    with pytest.raises(ValueError, match=r"max_model_len=129.*\[1, 128\]"):
        derive_max_model_len(_config("dynamic"), 129)


def test_dynamic_ntk_past_max_position_embeddings(tmp_path) -> None:
    """Dynamic NTK with max_position_embeddings=48: the 64-token prompt is prefilled with the base
    of length 64 and every decode step past 48 with the base of its own length, as transformers'
    generate does."""
    from pagedllm.testing.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path), "llama", max_position_embeddings=48,
                           rope_parameters=dict(SCALINGS["dynamic"], rope_theta=10000.0))
    expected = hf_greedy(path, prompts())
    assert max(len(p) + len(e) for p, e in zip(prompts(), expected)) > 48
    assert_greedy_matches(path, "plain", expected)
