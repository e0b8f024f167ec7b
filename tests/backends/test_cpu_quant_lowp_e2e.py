"""A GPTQ 8-bit per-channel symmetric checkpoint (tests/quantization/quant_writers.py) run in the
cpu backend's INT8 compute mode (PAGEDLLM_CPU_QUANT_LOWP_MODE=int8) against transformers on the
dequantized float32 twin: the mode is lossy (activations rounded to int8 per token), so the check
is closeness, not equality: every first-step logprob within 0.05 of transformers', and most
greedy tokens equal; and the default mode on the same checkpoint differs from it (the INT8 path
really ran)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quantization"))
from quant_writers import float_checkpoint, gptq_checkpoint, hf_reference, prompts  # noqa: E402

from pagedllm.backends.cpu import quant_lowp, quant_ops  # noqa: E402


def generate(path: str, ps: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype="float32")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[pos[t] for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
           for o in outs]
    return tokens, lps


@pytest.mark.skipif(not quant_lowp.available(), reason="oneDNN int8 linears not exact here")
def test_gptq_int8_lowp_close_to_transformers(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = float_checkpoint(str(tmp_path / "float"))
    path, twin = gptq_checkpoint(src, str(tmp_path / "gptq8"), 8, -1, True, False)
    ps = prompts()
    hf_tokens, hf_lps = hf_reference(twin, ps)
    monkeypatch.setenv(quant_ops.LOWP_MODE_ENV, "int8")
    tokens, lps = generate(path, ps)
    monkeypatch.setenv(quant_ops.LOWP_MODE_ENV, "none")
    exact_tokens, exact_lps = generate(path, ps)
    assert exact_tokens == [t[:8] for t in hf_tokens]  # the default mode: weight-only, exact
    for got, ref in zip(lps, hf_lps):
        assert abs(got[0] - ref[0]) < 0.05, (got[0], ref[0])
    same = sum(a == b for got, ref in zip(tokens, hf_tokens) for a, b in zip(got, ref))
    assert same >= 0.75 * sum(len(t) for t in tokens), (tokens, hf_tokens)
    assert max(abs(a - b) for got, ref in zip(lps, exact_lps) for a, b in zip(got, ref)) > 1e-6
