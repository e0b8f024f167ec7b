"""The backend conformance suite (pagedllm.testing) run for the in-tree cpu backend, exactly as a
vendor runs it for theirs: ``pytest --pyargs pagedllm.testing --device cpu`` (the default,
sampled sweep: docs/porting.md, "The declared space")."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest


def run_suite(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDLLM_TEST_DEVICE", None)
    env.pop("PAGEDLLM_BACKENDS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--pyargs", "pagedllm.testing", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_pytest_plugin_is_registered() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert names.get("pagedllm.testing.plugin") == "pagedllm.testing.plugin", (
        "the pytest11 entry point is missing: reinstall pagedllm (pip install -e .)")


def test_suite_passes_on_cpu(tmp_path) -> None:
    report = tmp_path / "cpu.json"
    proc = run_suite("--device", "cpu", "--conformance-report", str(report))
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-2000:]
    assert "pagedllm conformance: cpu" in out
    # cpu declares swap, prefix caching, chunked prefill and three dtypes; graphs and static
    # shapes are reported NOT DECLARED, never as passed
    rows = {line.split()[0]: line for line in out.splitlines() if "NOT DECLARED" in line}
    assert "graphs" in rows and "static_shapes" in rows, out[-4000:]
    assert "FAILED capabilities: none" in out
    for area in ("attention", "cache write/copy/swap", "end-to-end (HF equality)", "sampling",
                 "model ops", "contract", "declared limits", "KV block export/import"):
        assert area in out
    data = json.loads(report.read_text())
    if os.environ.get("PAGEDLLM_CI_REPORTS"):  # .ci/run's matrix leg merges it into the docs
        shutil.copy(report, os.path.join(os.environ["PAGEDLLM_CI_REPORTS"], "cpu.json"))
    assert data["backend"] == "cpu" and data["summary"]["FAIL"] == 0
    assert data["summary"]["PASS"] > 200 and data["commit"]
    swept = {c["block_size"] for c in data["checks"]
             if c["capability"] == "block sizes" and c["status"] == "PASS"}
    assert swept == {1, 2, 4, 8, 16, 32, 64, 128}  # every declared block size, not three
    figures = [c for c in data["checks"] if c["capability"] == "head sizes" and c["head_size"] == 80]
    assert figures and all(c["max_error"] is not None and c["nmse"] < 1e-3 for c in figures)
    # the declared space (issue 41): the default sweep reached what it promises
    assert data["sweep"]["mode"] == "pairs" and data["sweep"]["seed"] == 41
    shape = data["coverage"]["test_sweep::test_attention_sweep"]["shape"]
    assert max(shape["kv_heads"]) == 8 and max(shape["decodes"]) >= 67, shape
    assert max(shape["max_block_id"]) > 65535 and max(shape["max_seq_len"]) > 16384, shape
    assert max(shape["chunk_offsets"]) == 128 and max(shape["max_query"]) > 3 * 128, shape
    assert set(shape["head_size"]) == {16, 32, 40, 64, 72, 80, 96, 112, 128, 192, 256}, shape
    assert set(shape["kv_cache"]) >= {"float8_e4m3fn", "bfloat16", "float16", "float32"}, shape
    ops = data["coverage"]["test_ops_sweep::test_fused_moe_sweep"]["shape"]
    assert max(ops["experts"]) > 8 and 37 in ops["rows"], ops
    observed = {c["capability"] for c in data["checks"] if c["area"] == "claims (observed)"
                and c["status"] == "PASS"}
    assert {"chunked_prefill", "prefix_caching", "swap", "sliding_window", "logits_soft_cap",
            "kv cache fp8", "quantization fp8"} <= observed, observed
    assert any(c["capability"] == "deterministic" and c["status"] == "PASS"
               for c in data["checks"])


def test_unavailable_device_stops_the_run_with_the_reason() -> None:
    from pagedllm.backends.registry import discover

    unavailable = [n for n, i in discover().items() if not i.availability()[0]]
    if not unavailable:
        pytest.skip("every known backend is available here")
    name = unavailable[0]
    proc = run_suite("--device", name, timeout=300)
    assert proc.returncode == 4, proc.stdout[-3000:]  # pytest's usage-error status
    assert f"--device {name}" in proc.stderr and discover()[name].availability()[1] in proc.stderr


def test_unknown_device_lists_known_ones() -> None:
    proc = run_suite("--device", "quantum", timeout=300)
    assert proc.returncode == 4
    assert "not a known backend" in proc.stderr and "cpu" in proc.stderr
