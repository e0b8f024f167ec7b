"""Mixtral (8 experts, top 2, head_dim 96) equals transformers in every mode, with TP=2, and on
the cpu backend's grouped fused_moe path as well as the reference op."""
from __future__ import annotations

import pytest
from family_utils import (MODES, assert_greedy_matches, assert_sampled_logprobs_match, hf_greedy,
                          prompts)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory) -> tuple[str, list[list[int]]]:
    path = checkpoint_factory("mixtral")
    return path, hf_greedy(path, prompts())


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(mixtral, mode: str) -> None:
    path, expected = mixtral
    assert_greedy_matches(path, mode, expected)


def test_reference_op_matches_transformers(mixtral, monkeypatch) -> None:
    """The engine with the registry's per-expert reference in place of the backend's path."""
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.layers import moe_ops

    seen: list[bool] = []
    original = CpuBackend.register_ops

    def register_ops(self, ops) -> None:
        original(self, ops)
        seen.append(ops.fused_moe is not moe_ops.fused_moe)
        ops.register("fused_moe", moe_ops.fused_moe)

    monkeypatch.setattr(CpuBackend, "register_ops", register_ops)
    path, expected = mixtral
    assert_greedy_matches(path, "plain", expected)
    assert seen == [True]  # the cpu backend had registered its grouped path


def test_sampled_logprobs_match_transformers(mixtral) -> None:
    assert_sampled_logprobs_match(mixtral[0])


def test_tensor_parallel_2(mixtral) -> None:
    """Experts sharded on the intermediate dim (32 of 64 rows per rank), output all-reduced."""
    path, expected = mixtral
    assert_greedy_matches(path, "plain", expected, tensor_parallel_size=2)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_triton_moe_matches_transformers(mixtral) -> None:
    """On a GPU the cuda backend runs the Triton fused_moe (float32: IEEE dot products)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.backends.cuda import triton_moe

    path, expected = mixtral
    llm = LLM(path, device="cuda", dtype="float32")
    moe = llm.llm_engine.executor.worker.model.layers[0].mlp
    assert moe.ctx.ops.fused_moe is triton_moe.fused_moe
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_pipeline_parallel_2(mixtral) -> None:
    """Two stages of one layer each; a stage loads only its own layers' experts."""
    path, expected = mixtral
    assert_greedy_matches(path, "plain", expected, pipeline_parallel_size=2)
