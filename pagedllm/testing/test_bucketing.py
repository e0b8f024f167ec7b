"""Static-shape backends: steps reach attention padded to a few bucketed sizes, pad rows carry
slot -1, and the output still equals Hugging Face's."""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.e2e import MAX_TOKENS, first_mismatch

AREA = "bucketing (static shapes)"
NEEDS_ENGINE = True  # runs an LLM on the device (skipped for kernel-only backends)


@pytest.mark.capability("static_shapes")
@pytest.mark.capability("dtype:float32")
def test_steps_are_padded_to_buckets(conformance_backend: Backend, conformance_caps: Capabilities,
                                     conformance_checkpoint: str, conformance_device_name: str,
                                     conformance_hf_reference: tuple[list, list],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    ps, expected = conformance_hf_reference
    # a small token budget splits the prompts over several prefill steps, and different
    # max_tokens shrink the decode batch one sequence at a time: many distinct token counts
    budget = max(len(p) for p in ps) + MAX_TOKENS
    kwargs = dict(device=conformance_device_name, dtype="float32", enforce_eager=True,
                  block_size=conformance_caps.preferred_block_size, max_model_len=budget,
                  max_num_batched_tokens=budget, max_num_seqs=8)
    config = EngineArgs(model=conformance_checkpoint, **kwargs).create_engine_config()
    conformance_backend.check_and_update_config(config)
    attn_cls = conformance_backend.attention_cls(config)
    steps: list[tuple[int, int, list[int]]] = []  # (rows given, real tokens, slots of pad rows)
    original = attn_cls.forward

    def recording(self: AttentionImpl, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata) -> torch.Tensor:
        n = metadata.num_tokens
        steps.append((query.shape[0], n, metadata.slot_mapping[n:].tolist()))
        return original(self, query, key, value, kv_cache, metadata)

    monkeypatch.setattr(attn_cls, "forward", recording)
    llm = LLM(conformance_checkpoint, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - i, ignore_eos=True)
              for i in range(len(ps))]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    finally:
        llm.shutdown()  # the next check's engine needs the device memory back
    got = [o.outputs[0].token_ids for o in outs]
    expected = [e[:MAX_TOKENS - i] for i, e in enumerate(expected)]

    assert got == expected, first_mismatch(got, expected)
    assert steps, "attention forward was never called"
    assert all(rows >= n for rows, n, _ in steps), "a step had fewer rows than tokens"
    assert all(set(pad) <= {-1} for _, _, pad in steps), "pad rows must have slot -1"
    padded = {rows for rows, _, _ in steps}
    real = {n for _, n, _ in steps}
    assert any(rows > n for rows, n, _ in steps), "no step was padded"
    assert len(padded) < len(real), (
        f"{len(real)} distinct token counts reached attention as {len(padded)} distinct shapes "
        f"{sorted(padded)}: bucketing should map many counts onto few shapes")
