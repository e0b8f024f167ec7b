"""The one-launch decode step (csrc/decode_step_kernel.cu) against the layer-by-layer kernels it
replaces at batch 1, on random caches and block tables, and in the engine. Needs an sm_90+ GPU."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None
    or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ CUDA GPU")

# head size 128 (the kernel's), GQA 4, an intermediate size that is not a multiple of the
# GEMV's 4-row stages per block, a vocabulary whose rows do not split evenly over the SMs
SHAPE = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, intermediate_size=1000,
             num_hidden_layers=3, max_position_embeddings=2048, vocab_size=1003)
MAX_LEN = 2048


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def engine(path: str, **kw: object) -> LLM:
    return LLM(path, device="cuda", dtype="bfloat16", num_gpu_blocks_override=300,
               max_model_len=MAX_LEN, **kw)


def step_inputs(graphs, rng: random.Random, context: int, block_size: int, num_blocks: int,
                slot_valid: bool = True) -> None:
    """One sequence of `context` tokens (the new one included) on random distinct blocks."""
    width = graphs.block_tables.shape[1]
    used = -(-context // block_size)
    blocks = rng.sample(range(num_blocks), used)
    graphs.block_tables.zero_()
    graphs.block_tables[0, :used] = torch.tensor(blocks, dtype=torch.int32)
    assert used <= width
    last = context - 1
    slot = blocks[last // block_size] * block_size + last % block_size if slot_valid else -1
    graphs.input_ids[0] = rng.randrange(1003)
    graphs.positions[0] = last
    graphs.slots[0] = slot
    graphs.seq_lens[0] = context


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_step_matches_layer_by_layer_kernels(checkpoint_factory, arch: str,
                                             block_size: int) -> None:
    """Logits of one step over contexts of one partition (<= 64 tokens) and of several, up to the
    model length; the new token's k / v in the cache (bit for bit at layer 0, where nothing
    before the cache write differs); nothing written for slot -1."""
    from pagedllm.backends.cuda import decode_step, ops
    from pagedllm.backends.cuda.graphs import DecodeGraphs

    path = checkpoint_factory(arch, **SHAPE)
    llm = engine(path, enforce_eager=True, block_size=block_size, max_num_seqs=1)
    worker = llm.llm_engine.executor.worker
    model, caches = worker.model, worker.kv_caches
    kernels = ops.load_kernels()
    assert decode_step.unsupported_reason(model, kernels) is None
    step = decode_step.DecodeStep(model, kernels, caches, MAX_LEN)
    graphs = DecodeGraphs(model, caches, block_size, MAX_LEN, [1], caches[0].device)
    num_blocks = caches[0].shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen, device="cuda", dtype=torch.float32).to(c.dtype))
    rng = random.Random(4)
    with torch.inference_mode():
        for context, slot_valid in ((1, True), (40, True), (64, True), (65, True), (300, False),
                                    (777, True), (MAX_LEN, True)):
            step_inputs(graphs, rng, context, block_size, num_blocks, slot_valid)
            before = [c.clone() for c in caches]
            expected = graphs._forward(1, MAX_LEN)[0].float()
            after_layers = [c.clone() for c in caches]
            for c, b in zip(caches, before):
                c.copy_(b)
            got = torch.full_like(expected, float("nan"))
            step.run(graphs.input_ids[:1], graphs.positions[:1], graphs.slots[:1],
                     graphs.seq_lens[:1], graphs.block_tables[0], got)
            torch.cuda.synchronize()
            assert torch.isfinite(got).all(), context
            if slot_valid:  # else the layers' attention reads the stale cache row of the new token
                cos = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
                assert cos > 0.9995, (context, cos)
                scale = expected.abs().max()
                assert (got - expected).abs().max() <= 0.03 * scale, context
                # the same choice, up to near-ties within the attention's rounding
                assert expected[got.argmax()] >= expected.max() - 0.01 * scale, context
            assert torch.equal(caches[0], after_layers[0]), context
            for c, ref in zip(caches[1:], after_layers[1:]):
                torch.testing.assert_close(c.float(), ref.float(), atol=0.05, rtol=0.02)
            if not slot_valid:
                assert all(torch.equal(c, b) for c, b in zip(caches, before))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert step.step.max_partitions == min(sms, MAX_LEN // 64)  # units per kv head (1 kv head)


def test_engine_batch1_graphs_run_the_step_and_match_eager(checkpoint_factory,
                                                          monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "1")
    path = checkpoint_factory("llama", **SHAPE)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(90)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    outs = {}
    for eager in (True, False):
        llm = engine(path, enforce_eager=eager, max_num_seqs=1)
        graphs = llm.llm_engine.executor.worker.graphs
        assert (graphs is not None and graphs.step is not None) == (not eager)
        outs[eager] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[False].outputs[0].token_ids == outs[True].outputs[0].token_ids
    assert outs[False].outputs[0].cumulative_logprob == pytest.approx(
        outs[True].outputs[0].cumulative_logprob, rel=0.02, abs=0.05)


def test_unsupported_models_name_the_reason(checkpoint_factory, monkeypatch) -> None:
    from pagedllm.backends.cuda import decode_step, ops

    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "1")
    path = checkpoint_factory("llama", hidden_size=128, num_attention_heads=2,
                              num_key_value_heads=1)  # head size 64
    llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=1)
    worker = llm.llm_engine.executor.worker
    assert worker.graphs is not None and worker.graphs.step is None
    assert "head size 64" in decode_step.unsupported_reason(worker.model, ops.load_kernels())

