"""Speculative steps on static buffers (spec_decode/graphs.py), run eagerly on the cpu: the
layout a captured graph replays (q rows a sequence, pad rows after the real ones writing no KV,
padded sequences, the gather back to the packed rows, EAGLE-3's auxiliary states) gives the
tokens plain decoding gives. The capture itself needs a GPU (tests/backends/test_cuda_backend.py)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.batch import ScheduledSeq
from pagedllm.models.demo import DEMO_DIR
from pagedllm.spec_decode.graphs import SpecStepGraphs

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
           "def fib(n):\n    if n < 2:\n        return n\n    return ",
           "for i in range(10):\n    print(i)\n    print(i)\n    print(",
           "x = 1\n"]
K = 3


def _static_graphs(llm: LLM, sizes: list[int], verify_sizes: list[int],
                   buckets: list[int] | None = None) -> SpecStepGraphs:
    worker = llm.llm_engine.executor.worker
    config = worker.config
    graphs = SpecStepGraphs(worker.model, worker.kv_caches, config.cache.block_size,
                            config.model.max_model_len, K, sizes, verify_sizes, worker.device,
                            buckets, getattr(worker.proposer, "aux_states", None))
    worker.spec_runner.graphs = graphs
    return graphs


def _plain_tokens(params: SamplingParams) -> list[list[int]]:
    llm = LLM(DEMO_DIR, device="cpu", dtype="float32", seed=0, max_num_seqs=8)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    return out


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_static_steps_give_the_plain_tokens(method: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    llm = LLM(DEMO_DIR, device="cpu", dtype="float32", seed=0, max_num_seqs=8,
              speculative_config=spec)
    # sizes 2, 4 and 8 pad a batch of 5 (and of fewer, as requests finish); two decode buckets
    max_len = llm.llm_engine.config.model.max_model_len
    graphs = _static_graphs(llm, [2, 4, 8], [2, 4, 8], [64, max_len])
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    assert got == _plain_tokens(params)
    assert graphs.steps[K + 1] > 0, "no verification step ran on the static buffers"
    if method == "ngram":  # steps where no sequence found a match decode plainly
        assert graphs.steps[1] > 0, "no plain decode step ran on them"


def _seq(seq_id: int, tokens: list[int], start: int, spec: int) -> ScheduledSeq:
    return ScheduledSeq(seq_id=seq_id, token_ids=tokens, start_pos=start,
                        block_table=[0, 1, 2, 3], sampling_params=SamplingParams(),
                        num_samples=1, prompt_len=4, num_spec_tokens=spec)


def test_which_steps_have_a_static_shape() -> None:
    import torch

    g = SpecStepGraphs(torch.nn.Identity(), [], 16, 64, K, [1, 2, 4], [1, 2], torch.device("cpu"))
    assert g.query_len([_seq(0, [5], 10, 0)]) == 1
    assert g.query_len([_seq(0, [5, 6, 7], 10, 2), _seq(1, [5], 10, 0)]) == K + 1
    assert g.query_len([_seq(0, [5, 6], 10, 0)]) is None  # a prefill chunk
    assert g.query_len([_seq(0, [5] * 5, 10, 4)]) is None  # more drafts than k
    assert g.query_len([_seq(i, [5, 6], 10, 1) for i in range(3)]) is None  # past size 2
    assert g.query_len([_seq(i, [5], 10, 0) for i in range(4)]) == 1
    assert g.query_len([_seq(i, [5], 10, 0) for i in range(5)]) is None
    logprobs = _seq(0, [5], 10, 0)
    logprobs.prompt_logprob_targets = [1]
    assert g.query_len([logprobs]) is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecStepGraphs(torch.nn.Identity(), [], 16, 64, 0, [1], [1], torch.device("cpu"))
