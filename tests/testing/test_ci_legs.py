""".ci/run's leg handling and tools/support_matrix.py, run on copies in a scratch tree."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scratch_ci(tmp_path: Path, leg_script: str | None, executable: bool) -> Path:
    """A tree holding .ci/run and, optionally, a leg_tpu.sh that succeeds."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    if leg_script is not None:
        script = tmp_path / ".ci" / "leg_tpu.sh"
        script.write_text(leg_script)
        script.chmod(0o755 if executable else 0o644)
    return tmp_path


def _run_ci(tree: Path, legs: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PAGEDLLM_CI_LEGS=legs, PAGEDLLM_CI_REPORTS=str(tree / "reports"))
    return subprocess.run(["bash", str(tree / ".ci" / "run")], capture_output=True, text=True,
                          env=env, timeout=120)


def test_unknown_leg_fails_before_anything_runs(tmp_path: Path) -> None:
    tree = _scratch_ci(tmp_path, "#!/usr/bin/env bash\necho ran > ran.txt\n", True)
    proc = _run_ci(tree, "tpu gpu-h100")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown CI leg 'gpu-h100'" in proc.stderr and "tpu" in proc.stderr
    assert not (tree / "ran.txt").exists()


def test_non_executable_or_missing_leg_script_fails(tmp_path: Path) -> None:
    tree = _scratch_ci(tmp_path, "#!/usr/bin/env bash\necho '1 passed'\n", False)
    proc = _run_ci(tree, "tpu xpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "leg_tpu.sh is not executable" in proc.stderr
    assert "leg_xpu.sh is missing" in proc.stderr
    rows = proc.stdout.split("CI matrix")[1]
    assert "tpu" in rows and "xpu" in rows and rows.count("FAIL") == 2


def test_executable_leg_runs_and_passes(tmp_path: Path) -> None:
    tree = _scratch_ci(tmp_path, "#!/usr/bin/env bash\necho '3 passed'\n", True)
    proc = _run_ci(tree, "tpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " ok " in proc.stdout.split("CI matrix")[1]


def _report(backend: str, status: str) -> dict:
    return {"backend": backend, "source": "built-in", "commit": "abc123",
            "summary": {"PASS": 1, "FAIL": int(status == "FAIL")},
            "matrix": [{"capability": "head sizes", "dtype": "float32", "status": status,
                        "passed": 1, "failed": int(status == "FAIL"), "head_sizes": [64, 80]},
                       {"capability": "graphs", "dtype": None, "status": "NOT DECLARED"}]}


def test_support_matrix_merges_reports_and_detects_staleness(tmp_path: Path) -> None:
    tool = [sys.executable, str(ROOT / "tools" / "support_matrix.py")]
    page = tmp_path / "support_matrix.md"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report("alpha", "PASS")))
    b.write_text(json.dumps(_report("beta", "FAIL")))
    subprocess.run([*tool, str(a), str(b), "-o", str(page)], check=True, capture_output=True)
    text = page.read_text()
    assert "## alpha" in text and "## beta" in text and "PASS (hs 64,80)" in text
    assert "**FAIL** 1/2" in text and "NOT DECLARED" in text and "commit `abc123`" in text
    # a new commit with the same results is not stale; a changed result is
    b.write_text(json.dumps(dict(_report("beta", "FAIL"), commit="def456")))
    assert subprocess.run([*tool, "--check", str(b), "-o", str(page)],
                          capture_output=True).returncode == 0
    b.write_text(json.dumps(_report("beta", "PASS")))
    stale = subprocess.run([*tool, "--check", str(b), "-o", str(page)], capture_output=True,
                           text=True)
    assert stale.returncode == 1 and "stale" in stale.stderr
    # one leg's report rewrites its own section only
    subprocess.run([*tool, str(b), "-o", str(page)], check=True, capture_output=True)
    assert "## alpha" in page.read_text() and "**FAIL**" not in page.read_text()
