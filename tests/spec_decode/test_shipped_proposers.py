"""The demo model's shipped draft model and EAGLE-3 head (pagedllm/models/demo_model/{draft,eagle},
trained by tools/train_draft_model.py): a speculative config that names only the method finds
them, greedy output is the demo model's own token for token, they draft tokens the demo model
accepts on code, and together they stay inside the package budget."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.demo import DEMO_DIR

PROMPT = ("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run.\"\"\"\n"
          "    parser = ")
BUDGET_BYTES = 8 * 1024 * 1024


def generate(speculative_config: dict | None) -> tuple[list[int], dict | None]:
    llm = LLM(DEMO_DIR, device="cpu", dtype="float32", seed=0,
              speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    metrics = getattr(llm.llm_engine.stepper, "metrics", None)
    result = (list(out), dict(metrics.as_dict()) if metrics is not None else None)
    llm.shutdown()
    return result


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return generate(None)[0]


@pytest.mark.parametrize("method,folder", [("eagle", "eagle"), ("draft", "draft")])
def test_shipped_proposer_is_used_and_exact(plain: list[int], method: str, folder: str) -> None:
    path = Path(DEMO_DIR) / folder
    assert (path / "config.json").is_file(), f"{path} is not shipped"
    tokens, metrics = generate({"method": method, "num_speculative_tokens": 4,
                                "disable_by_batch_size": 1000})
    assert tokens == plain
    assert metrics is not None and metrics["num_drafts"] > 0
    # a proposer trained on the demo model's code gets most drafts accepted on code
    assert metrics["acceptance_rate"] > 0.3, metrics


def test_shipped_proposers_fit_the_budget_and_have_cards() -> None:
    total = 0
    for folder in ("draft", "eagle"):
        path = Path(DEMO_DIR) / folder
        total += sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        card = (path / "README.md").read_text()
        assert "tools/train_draft_model.py" in card
        metrics = json.loads((path / "metrics.json").read_text())
        assert metrics["expected_mean_accepted_length_k4"] > 1.5
    assert total <= BUDGET_BYTES, f"shipped proposers take {total / 2**20:.2f} MB (budget 8 MB)"
