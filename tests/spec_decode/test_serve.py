"""``pagedllm serve --speculative-config JSON``: a real server process with a draft model, the
real ``openai`` client, and the spec_decode Prometheus metrics on /metrics."""
from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "entrypoints"))
from cli_server import CliServer  # noqa: E402


def _metrics(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {s.name + (f"[{s.labels['position']}]" if "position" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.timeout(600)
def test_serve_with_a_draft_model_reports_spec_decode_metrics(llama_path: str, tmp_path) -> None:
    import openai

    spec = {"model": llama_path, "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    server = CliServer([llama_path, "--speculative-config", json.dumps(spec),
                        "--num-gpu-blocks-override", "256", "--max-model-len", "256"],
                       tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as c:
            plain = c.completions.create(model=llama_path, prompt=[10, 11, 12, 13], max_tokens=16,
                                         temperature=0.0, extra_body={"ignore_eos": True})
            streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
                model=llama_path, prompt=[10, 11, 12, 13], max_tokens=16, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True}))
        assert plain.usage.completion_tokens == 16
        assert streamed == plain.choices[0].text
        m = _metrics(server.base_url)
        drafts = m["pagedllm:spec_decode_num_draft_tokens_total"]
        assert drafts > 0
        # the target drafting for itself: every draft accepted, 4 tokens per full verification
        assert m["pagedllm:spec_decode_num_accepted_tokens_total"] == drafts
        assert m["pagedllm:spec_decode_draft_acceptance_rate"] == 1.0
        assert m["pagedllm:spec_decode_num_emitted_tokens_total"] == (
            drafts + m["pagedllm:spec_decode_num_drafts_total"])
        assert m["pagedllm:spec_decode_mean_accepted_length"] > 3.0
        assert m["pagedllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] > 0
    finally:
        server.stop()
