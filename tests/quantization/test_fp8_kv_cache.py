"""kv_cache_dtype="fp8" on the cpu backend: e4m3 K/V (scale 1.0) in the torch attention, in
block copies and in swaps.

Tolerance (documented in README): teacher-forced against transformers' float32 model, the
chosen tokens' logprobs agree within 0.05 (fp8 rounding is up to 2^-4 relative per cached
value); greedy runs may part ways at near ties. Within the engine the
fp8 cache is exact: preemption by swap, prefix caching and chunked prefill move or reuse the
same bytes, so their greedy outputs equal the plain fp8 run's token for token."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from quant_writers import float_checkpoint, prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return float_checkpoint(str(tmp_path_factory.mktemp("kv-fp8")))


def run(path: str, max_tokens: int = MAX_TOKENS, device: str = "cpu", **kwargs
        ) -> tuple[LLM, list]:
    llm = LLM(path, device=device, dtype="float32", kv_cache_dtype="fp8", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        return llm, [o.outputs[0] for o in outs]
    finally:
        llm.llm_engine.shutdown()


def worker_facts(path: str, device: str = "cpu") -> tuple[dict, list]:
    """What the worker holds while the engine runs (a shut-down engine has released its model
    and caches), and the engine's outputs."""
    llm = LLM(path, device=device, dtype="float32", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        worker = llm.llm_engine.executor.worker
        impls = [layer.self_attn.attn.impl for layer in worker.model.layers]
        facts = dict(cache_dtype=worker.kv_caches[0].dtype, attn=worker.attn_cls.name,
                     scales=[(im.k_scale, im.v_scale) for im in impls])
        return facts, [o.outputs[0] for o in outs]
    finally:
        llm.llm_engine.shutdown()


def assert_close_teacher_forced(path: str, outs: list) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, out in zip(prompts(), outs):
        with torch.no_grad():
            logits = model(torch.tensor([p + out.token_ids])).logits[0]
        ref = torch.log_softmax(logits.float(), -1)[len(p) - 1:-1]  # [MAX_TOKENS, vocab]
        for i, tok in enumerate(out.token_ids):
            assert out.logprobs[i][tok] == pytest.approx(ref[i, tok].item(), abs=0.05)
            assert ref[i].max().item() - ref[i, tok].item() <= 0.05


def test_close_to_transformers(path: str) -> None:
    """Teacher-forced on pagedllm's tokens, transformers' float32 logprobs of those tokens are
    within 0.05, and each token is transformers' argmax or within 0.05 of it (a near tie that
    fp8 rounding may flip; greedy runs then part ways, so token lists are not compared)."""
    facts, outs = worker_facts(path)
    assert facts["cache_dtype"] == torch.float8_e4m3fn
    assert facts["attn"] == "torch"
    assert_close_teacher_forced(path, outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_close_to_transformers_on_cuda(path: str) -> None:
    """The same on the cuda backend: its torch attention reads the e4m3 cache (eager)."""
    facts, outs = worker_facts(path, device="cuda")
    assert facts["cache_dtype"] == torch.float8_e4m3fn
    assert facts["attn"] == "torch"
    assert_close_teacher_forced(path, outs)


def test_checkpoint_kv_scales(path: str, tmp_path) -> None:
    """Per-tensor k_scale / v_scale tensors of a checkpoint reach the attention layers (and the
    checkpoint still loads: they are no model parameters)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    dst = str(tmp_path / "scaled")
    shutil.copytree(path, dst)
    state = load_file(os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as fh:
        layers = json.load(fh)["num_hidden_layers"]
    for i in range(layers):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5 + i)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    facts, outs = worker_facts(dst)
    assert facts["scales"] == [(0.25, 0.5 + i) for i in range(layers)]
    assert_close_teacher_forced(path, outs)


@pytest.mark.parametrize("mode", [
    dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="swap"),
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16,
         max_num_seqs=4),
])
def test_swap_and_cached_context_are_exact(path: str, mode: dict) -> None:
    _, plain = run(path, 40)  # 40 tokens: the sequences outgrow 12 blocks
    llm, outs = run(path, 40, **mode)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if "preemption_mode" in mode:
        assert llm.llm_engine.stats().num_preemptions > 0


def test_fp8_halves_block_bytes_and_refuses_native(path: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    base = LLM(path, device="cpu", dtype="float32", attention_backend="torch")
    fp8, _ = run(path)
    try:
        assert fp8.llm_engine.executor.worker.block_bytes() * 4 == \
            base.llm_engine.executor.worker.block_bytes()
    finally:
        base.llm_engine.shutdown()
    config = EngineArgs(model=path, device="cpu", kv_cache_dtype="fp8",
                        attention_backend="native").create_engine_config()
    from pagedllm.backends.cpu.backend import CpuBackend

    with pytest.raises(ValueError, match="attention_backend='native' does not support "
                                         "kv_cache_dtype='fp8'"):
        CpuBackend().attention_cls(config)
