"""The built-in demo model (pagedllm/models/demo.py) and the script that trains it.

The shipped model must give transformers' greedy tokens, and tools/train_demo_model.py must
write a folder that both load (checked on a tiny run, so it works before the weights exist).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models import demo

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]
MAX_TOKENS = 32


def load_tool(name: str) -> ModuleType:
    """A module of tools/ (not a package), by file path."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo_data = load_tool("demo_data")


def hf_greedy(path: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[str]]:
    """(new token ids, their text) per prompt, float32, EOS ignored, as the prompts tokenize."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.pad_token_id)
    ids = []
    with torch.no_grad():
        for p in prompts:
            prompt = tok(p, return_tensors="pt").input_ids
            ids.append(model.generate(prompt, generation_config=cfg)[0, prompt.shape[1]:].tolist())
    return ids, [tok.decode(i, skip_special_tokens=True) for i in ids]


def pagedllm_greedy(model: str, prompts: list[str],
                    max_tokens: int) -> tuple[list[list[int]], list[str]]:
    llm = LLM(model, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


needs_weights = pytest.mark.skipif(bool(demo.missing_files()),
                                   reason=f"demo model not built: {demo.DEMO_DIR} lacks "
                                          f"{', '.join(demo.missing_files())}")


@needs_weights
def test_demo_model_is_the_default_and_matches_transformers() -> None:
    from pagedllm.engine.arg_utils import EngineArgs, resolve_model_path

    assert resolve_model_path(EngineArgs().model) == demo.DEMO_DIR
    expected = hf_greedy(demo.DEMO_DIR, PROMPTS, MAX_TOKENS)
    assert pagedllm_greedy(EngineArgs().model, PROMPTS, MAX_TOKENS) == expected


@needs_weights
def test_demo_model_fits_in_the_package() -> None:
    sizes = {f: os.path.getsize(os.path.join(demo.DEMO_DIR, f)) for f in os.listdir(demo.DEMO_DIR)}
    assert sum(sizes.values()) <= 40e6, sizes
    assert {"README.md", "generation_config.json", "loss_curve.png"} <= set(sizes)


def write_fake_stdlib(root: Path) -> None:
    """A dozen small modules, one of them in the held-out split."""
    names = [f"pkg/mod_{i}.py" for i in range(400)]
    chosen = [n for n in names if not demo_data.is_heldout(n)][:12]
    chosen.append(next(n for n in names if demo_data.is_heldout(n)))
    for i, name in enumerate(chosen):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(textwrap.dedent(f'''
            import os


            def function_{i}_{j}(path, count={j}):
                """Return the first lines of a file."""
                with open(path) as f:
                    return [line.rstrip() for line in f][:count]
            ''') for j in range(8)))
    (root / "site-packages" / "ignored.py").parent.mkdir()
    (root / "site-packages" / "ignored.py").write_text("x = 1\n")


def run_tool(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOLS / "train_demo_model.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_train_script_writes_a_folder_both_engines_load(tmp_path: Path) -> None:
    write_fake_stdlib(tmp_path / "lib")
    corpus = str(tmp_path / "corpus.jsonl.gz")
    # what --corpus-out does, without starting a second process that imports torch
    demo_data.write_corpus(demo_data.build_corpus(str(tmp_path / "lib")), corpus)
    out = tmp_path / "model"
    run_tool("--corpus", corpus, "--out", str(out), "--device", "cpu", "--vocab-size", "300",
             "--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1",
             "--intermediate-size", "64", "--max-position", "128", "--seq-len", "32",
             "--batch-size", "4", "--max-steps", "6", "--time-budget-s", "0",
             "--max-epochs", "0", "--eval-every", "3", "--log-every", "2", "--sample-tokens", "4")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "loss_log.json", "metrics.json"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["training"]["steps"] == 6 and metrics["corpus"]["heldout_files"] == 1
    assert metrics["corpus"]["train_files"] == 12  # site-packages is left out
    assert metrics["heldout"]["model_ppl"] > 1 and metrics["heldout"]["unigram_ppl"] > 1
    card = "\n".join(load_tool("make_model_card").sections(metrics, str(out)))  # no plot here
    assert "## Evaluation" in card and metrics["samples"][0]["prompt"] in card
    # token ids only: random weights emit stray bytes, which the engine's detokenizer holds back
    got, _ = pagedllm_greedy(str(out), ["def f", "import"], 8)
    assert got == hf_greedy(str(out), ["def f", "import"], 8)[0]
