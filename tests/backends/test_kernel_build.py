"""The JIT kernel cache: a library already in its build directory (named by the hash of every
input) loads as it is, without a build, even when the sources' timestamps are new."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.backends import kernel_build
from pagedllm.backends.cpu import kernels as cpu_kernels_module


def test_a_library_in_the_build_dir_loads_without_a_build(cpu_kernels, tmp_path: Path) -> None:
    built = cpu_kernels_module.library_build_dir("pagedllm_cpu")
    copy = tmp_path / "build"
    shutil.copytree(built, copy)  # fresh timestamps, as on a machine the cache was copied to
    script = textwrap.dedent(f"""
        import torch, torch.utils.cpp_extension as ext
        def refuse(**kwargs):
            raise SystemExit("a build was started")
        ext.load = refuse
        from pathlib import Path
        from pagedllm.backends.kernel_build import jit_load
        assert jit_load("pagedllm_cpu", [], Path({str(copy)!r}), is_python_module=False) is None
        print(hasattr(torch.ops.pagedllm_cpu, "paged_attention_decode"))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "True"


def test_a_library_that_does_not_load_is_built_again(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as ext

    (tmp_path / "pagedllm_x.so").write_bytes(b"not a library")  # a build killed mid-link
    calls: list[dict] = []
    monkeypatch.setattr(ext, "load", lambda **kwargs: calls.append(kwargs) or "built")
    assert kernel_build.jit_load("pagedllm_x", ["x.cpp"], tmp_path, extra_cflags=["-O2"]) == "built"
    assert calls == [dict(name="pagedllm_x", sources=["x.cpp"], build_directory=str(tmp_path),
                          is_python_module=True, extra_cflags=["-O2"])]
