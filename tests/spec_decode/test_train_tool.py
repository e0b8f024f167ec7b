"""tools/train_draft_model.py at toy size on CPU: it writes a draft model and an EAGLE-3 head
in the formats the engine loads, and the demo model with either gives its plain greedy output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")


def _corpus(path: str) -> str:
    """Six stdlib files, one under a path the demo split holds out."""
    sys.path.insert(0, TOOLS)
    import demo_data

    std = demo_data.default_stdlib()
    names = ["json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py", "json/scanner.py"]
    docs = [{"path": n, "text": open(os.path.join(std, n)).read()} for n in names]
    held = next(f"heldout/{i}.py" for i in range(1000) if demo_data.is_heldout(f"heldout/{i}.py"))
    docs.append({"path": held, "text": open(os.path.join(std, "json/tool.py")).read()})
    demo_data.write_corpus({"meta": {"source": "test"}, "docs": docs}, path)
    return path


@pytest.mark.timeout(600)
def test_toy_training_writes_loadable_proposers(tmp_path) -> None:
    from pagedllm.models.demo import missing_files

    if missing_files():
        pytest.skip("the demo model's weights are not in this checkout")
    draft, eagle = str(tmp_path / "draft"), str(tmp_path / "eagle")
    cmd = [sys.executable, os.path.join(TOOLS, "train_draft_model.py"),
           "--corpus", _corpus(str(tmp_path / "corpus.jsonl")), "--out-draft", draft,
           "--out-eagle", eagle, "--device", "cpu", "--max-steps", "2", "--time-budget-s", "0",
           "--max-epochs", "0", "--seq-len", "32", "--batch-size", "2",
           "--draft-hidden-size", "64", "--draft-layers", "1", "--draft-heads", "1",
           "--draft-intermediate-size", "64", "--eagle-intermediate-size", "64",
           "--eagle-draft-vocab", "512", "--eagle-ttt-steps", "2", "--eval-windows", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shipped weights" in done.stderr
    for folder, kind in ((draft, "draft_model"), (eagle, "eagle")):
        assert {"config.json", "model.safetensors", "metrics.json"} <= set(os.listdir(folder))
        with open(os.path.join(folder, "metrics.json")) as f:
            report = json.load(f)
        assert report["kind"] == kind and report["training"]["steps"] == 2
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os\n"]
    want = [o.outputs[0].token_ids
            for o in LLM("pagedllm-demo", dtype="float32").generate(prompts, params,
                                                                     use_tqdm=False)]
    for folder, method in ((draft, "draft_model"), (eagle, "eagle3")):
        llm = LLM("pagedllm-demo", dtype="float32",
                  speculative_config={"model": folder, "num_speculative_tokens": 3})
        assert llm.llm_engine.config.speculative_config.method == method
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.llm_engine.stepper.metrics.num_draft_tokens > 0
