"""Issue 28 item 9: ``pagedllm bench`` shows a progress bar, runs the HF peer on the same prompts
and writes its results as JSON and a plot (the CLI as a subprocess, a tiny random checkpoint)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_bench_vs_hf_with_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pagedllm.testing.checkpoints import make_checkpoint

    model = make_checkpoint(str(tmp_path / "tiny"), "llama")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "--model", model,
         "--device", "cpu", "--dtype", "float32", "--num-prompts", "3", "--input-len", "5",
         "--output-len", "4", "--warmup-prompts", "1", "--peer", "hf",
         "--output-json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "100%|" in run.stderr  # tqdm's bar, on stderr
    report = json.loads(out_json.read_text())
    assert report["workload"]["num_prompts"] == 3 and report["workload"]["dtype"] == "float32"
    for engine in ("pagedllm", "hf"):
        r = report["results"][engine]
        assert r["requests"] == 3 and r["output_tokens"] == 12 and r["output_tok_s"] > 0
    ratio = report["ratios"]["pagedllm/hf"]
    assert ratio == pytest.approx(report["results"]["pagedllm"]["output_tok_s"]
                                  / report["results"]["hf"]["output_tok_s"])
    assert f"pagedllm/hf: {ratio:.2f}x" in run.stdout
    png = out_png.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 2000


def test_plot_to_a_missing_folder_fails_before_the_run(tmp_path: Path) -> None:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench",
                          "--plot", str(tmp_path / "nope" / "x.png")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--plot" in run.stderr and "does not exist" in run.stderr
