"""Speculative decoding on the tpu backend. Without torch_xla: the row buckets cover
verification rows and what the backend accepts (n-gram) and refuses (a draft model or EAGLE
head, by name). With XLA on the host CPU (the tpu CI leg): n-gram greedy output equals
transformers' (which the plain tpu engine equals, test_tpu.py) token for token with drafts
accepted, verification steps compile nothing after the warm-up, and no block leaks."""
from __future__ import annotations

import pytest

from pagedllm.backends.tpu.backend import TpuBackend
from pagedllm.backends.tpu.buckets import BucketGrid

XLA_READY = TpuBackend.availability()[0]
needs_xla = pytest.mark.skipif(not XLA_READY, reason="needs torch_xla with a TPU, or "
                               "PJRT_DEVICE=CPU PAGEDLLM_TPU_ALLOW_CPU=1 (the tpu CI leg)")

# repetitive prompts: n-gram lookup finds drafts in them and in the tiny model's loops
PROMPTS = [[5, 17, 99, 3, 42, 8, 8, 11, 250], [7, 7, 7, 8, 9, 7, 7, 7, 8],
           list(range(3, 40)), [100, 101, 102, 100, 101, 102, 100]]
MAX_TOKENS = 24
# speculate in every step (the adaptive guard picks by measured speed: not deterministic)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 64}


def test_row_buckets_cover_verification_rows() -> None:
    """With k = 3, a step of 8 verified sequences samples 32 rows: a row bucket, not all rows."""
    grid = BucketGrid.from_limits(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=128,
                                  block_size=16, rows_per_seq=4)
    assert grid.row_buckets == (8, 16, 32)
    heads = set(grid.head_shapes())
    for tokens in range(1, 129):
        for rows in range(0, min(tokens, 32) + 1):
            s = grid.shape_for(tokens, rows, 8)
            assert s.rows >= rows and (s.tokens, s.rows) in heads
            assert s.rows <= max(8, 2 * rows)  # the smallest bucket that holds them
    with pytest.raises(ValueError, match="rows_per_seq=0"):
        BucketGrid.from_limits(16, 8, 16, 16, rows_per_seq=0)


def test_ngram_is_accepted_and_device_proposers_are_refused(llama_path: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.speculative import check_speculative

    def config(spec: dict):
        return EngineArgs(model=llama_path, speculative_config=spec).create_engine_config()

    check_speculative(config(NGRAM), TpuBackend())
    draft = config({"model": llama_path, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.method='draft_model' is not "
                                         r"supported by the tpu backend.*allowed there: 'ngram'"):
        check_speculative(draft, TpuBackend())


@pytest.fixture(scope="module")
def expected(llama_path: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
                for p in PROMPTS]


def _assert_drained(llm) -> None:
    """Every block back in the pool (free or idle in the prefix cache), no sequence state."""
    bm = llm.llm_engine.block_manager
    assert bm.device.num_free + bm.device.num_cached_idle == bm.num_device_blocks
    assert bm.num_tracked_seqs() == 0


@needs_xla
@pytest.mark.parametrize("mode", ["plain", "chunked_prefill"])
def test_ngram_greedy_equals_transformers_and_compiles_nothing(mode: str, llama_path: str,
                                                               expected: list[list[int]]) -> None:
    """n-gram speculation on XLA: the tokens transformers' greedy decoding gives, with drafts
    accepted; verification steps (1 + k query tokens per sequence, beside prompts, prompt
    chunks and plain decodes) land in the warm-up's buckets: no XLA compilation after it."""
    import torch_xla.debug.metrics as met

    from pagedllm import LLM, SamplingParams

    def compiles() -> int:
        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    kwargs = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)
    if mode == "chunked_prefill":  # prompt chunks beside verification chunks, 16-token steps
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
                      enable_prefix_caching=True)
    llm = LLM(llama_path, device="tpu", dtype="float32", speculative_config=NGRAM, **kwargs)
    warm = compiles()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert compiles() == warm, "a verification step compiled a program the warm-up did not"
    metrics = llm.llm_engine.stepper.metrics
    assert metrics.num_accepted_tokens > 0, (metrics.num_draft_tokens, "no draft accepted")
    shapes = llm.llm_engine.executor.worker.runner.shapes_run
    assert any(s.rows > 8 for s in shapes) or mode != "plain", shapes  # verification rows
    _assert_drained(llm)
