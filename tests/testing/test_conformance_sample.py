"""--conformance-sample (pagedllm/testing/sample.py): each check keeps few cases, every declared
parameter value still runs, the rest are reported SKIPPED (sampled out); and kernel-only
backends skip the engine-level checks with their reason."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pagedllm.testing.sample import choose, engine_skip, sample_limit


def test_choose_covers_every_value_then_fills_to_the_limit() -> None:
    cases = [dict(dtype=d, hs=h) for d in ("f32", "bf16", "f16") for h in (32, 64, 80, 96, 112)]
    for limit in (1, 5, 9):
        picked = [cases[i] for i in choose(cases, limit)]
        assert {c["dtype"] for c in picked} == {"f32", "bf16", "f16"}
        assert {c["hs"] for c in picked} == {32, 64, 80, 96, 112}
        assert len(picked) == max(limit, 5)
        assert len({tuple(c.items()) for c in picked}) == len(picked)
    # values spread over the other dimension: no dtype runs most of the head sizes alone
    picked = [cases[i] for i in choose(cases, 1)]
    assert max(sum(c["dtype"] == d for c in picked) for d in ("f32", "bf16", "f16")) == 2
    assert len(choose(cases, 100)) == len(cases)


def test_sample_limit_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CONFORMANCE_SAMPLE", raising=False)
    assert sample_limit(None) is None and sample_limit("all") is None and sample_limit("3") == 3
    monkeypatch.setenv("PAGEDLLM_CONFORMANCE_SAMPLE", "2")
    assert sample_limit(None) == 2
    with pytest.raises(ValueError, match="PAGEDLLM_CONFORMANCE_SAMPLE='-1'"):
        sample_limit("-1")


def test_engine_level_checks_skip_only_for_kernel_only_backends() -> None:
    engine, kernel = types.SimpleNamespace(NEEDS_ENGINE=True), types.SimpleNamespace()
    stand_in = type("StandIn", (), {"conformance_kernels_only": "kernels on an emulator"})
    assert "kernels on an emulator" in engine_skip(stand_in, engine)
    assert engine_skip(stand_in, kernel) is None
    assert engine_skip(type("Real", (), {}), engine) is None
    quant = types.SimpleNamespace(__name__="pagedllm.testing.test_quant_linear")
    partial = type("Partial", (stand_in,), {"conformance_not_covered": {
        "test_quant_linear": "no emulated quant kernels"}})
    assert "no emulated quant kernels" in engine_skip(partial, quant)
    assert engine_skip(stand_in, quant) is None


def test_sampled_run_reports_the_rest_as_skipped(tmp_path: Path) -> None:
    """The cpu cache-write check (3 dtypes x 3 block sizes) with --conformance-sample 1: three
    cases run, covering every dtype and block size; six are SKIPPED as sampled out."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
         "pagedllm.testing.test_cache", "-k", "write_kv", "--device", "cpu",
         "--conformance-sample", "1", "--conformance-report", str(report)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    checks = json.loads(report.read_text())["checks"]
    ran = [c for c in checks if c["status"] == "PASS"]
    out = [c for c in checks if c["status"] == "SKIPPED"]
    assert len(checks) == 9 and len(ran) == 3 and len(out) == 6, [c["status"] for c in checks]
    assert {c["dtype"] for c in ran} == {"float32", "bfloat16", "float16"}
    assert len({c["block_size"] for c in ran}) == 3
    assert all("sampled out" in c["message"] for c in out)
    assert "sampled: at most 1 case(s) per check" in proc.stdout
