"""Issue 28 item 8: the kernel-build message is logged when a build actually runs, not on every
load of an already built library (pagedllm/backends/kernel_build.py)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from pagedllm.backends.kernel_build import build_directory, jit_load


def test_build_message_only_when_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    if shutil.which("g++") is None or shutil.which("ninja") is None:
        pytest.skip("needs g++ and ninja")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int pagedllm_build_probe() { return 7; }\n')
    build_dir = build_directory([str(source)], "cpu", {"cxx": ["-O0"]})
    with caplog.at_level(logging.INFO, logger="pagedllm.backends.kernel_build"):
        jit_load("pagedllm_build_probe", [str(source)], build_dir, is_python_module=False,
                 build_time="~1 s", extra_cflags=["-O0"])
    built = [r.getMessage() for r in caplog.records if "building" in r.getMessage()]
    assert len(built) == 1 and "pagedllm_build_probe" in built[0] and "~1 s" in built[0]
    assert (build_dir / "pagedllm_build_probe.so").is_file()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="pagedllm.backends.kernel_build"):
        jit_load("pagedllm_build_probe", [str(source)], build_dir, is_python_module=False,
                 build_time="~1 s", extra_cflags=["-O0"])
    assert not [r for r in caplog.records if "building" in r.getMessage()]
