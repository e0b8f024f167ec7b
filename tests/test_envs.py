"""pagedllm/envs.py: the one table of environment variables.

* every ``PAGEDLLM_*`` name the code reads (python: a string constant that is exactly a name, as
  ``os.environ.get("PAGEDLLM_X")`` or ``X_ENV = "PAGEDLLM_X"`` spell it, or ``envs.PAGEDLLM_X``;
  shell: ``$PAGEDLLM_X``, ``${PAGEDLLM_X...}`` or ``PAGEDLLM_X=``) is in the table, and every
  entry is used somewhere;
* docs/envs.md is what tools/gen_env_docs.py writes from the table;
* values are read when asked for, and importing pagedllm reads none;
* one on/off grammar; bad values name the variable, the value and the allowed values.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parent.parent
PY_DIRS = ("pagedllm", "benchmarks", "tools", "csrc", "tests", "examples")
SHELL_FILES = ("*.sh", "run", "Dockerfile*")
SHELL_DIRS = (".ci", "benchmarks", "docker", "examples")
NAME = re.compile(r"_?PAGEDLLM_[A-Z0-9_]*[A-Z0-9]")
SHELL_READ = re.compile(r"\$\{?(_?PAGEDLLM_[A-Z0-9_]*[A-Z0-9])"  # $X, ${X...}
                        r"|(?<![\w-])(_?PAGEDLLM_[A-Z0-9_]*[A-Z0-9])=")  # X=... (not -DX=)


def names_in_python(source: str) -> set[str]:
    """PAGEDLLM_* names a python file reads: string constants that are exactly a name (a key of
    os.environ / getenv, or a constant holding one) and ``envs.NAME`` attributes."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and NAME.fullmatch(node.value):
            found.add(node.value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "envs" and NAME.fullmatch(node.attr):
            found.add(node.attr)
    return found


def names_in_shell(text: str) -> set[str]:
    return {a or b for line in text.splitlines() if not line.lstrip().startswith("#")
            for a, b in SHELL_READ.findall(line)}


def python_files() -> list[Path]:
    return sorted(p for d in PY_DIRS for p in (ROOT / d).rglob("*.py")) + [ROOT / "setup.py"]


def shell_files() -> list[Path]:
    return sorted({p for d in SHELL_DIRS if (ROOT / d).is_dir() for pattern in SHELL_FILES
                   for p in (ROOT / d).rglob(pattern) if p.is_file()})


def names_read() -> dict[str, str]:
    """name -> the first file that reads it."""
    read: dict[str, str] = {}
    for path in python_files():
        if path.name == "test_envs.py":
            continue  # this file's examples
        for name in names_in_python(path.read_text()):
            read.setdefault(name, str(path.relative_to(ROOT)))
    for path in shell_files():
        for name in names_in_shell(path.read_text(errors="replace")):
            read.setdefault(name, str(path.relative_to(ROOT)))
    return read


def test_scanner_finds_reads() -> None:
    """The scanner itself: each way of reading is seen, a mere mention in text is not."""
    code = ('import os\nfrom pagedllm import envs\nA = os.environ.get("PAGEDLLM_ONE")\n'
            'B_ENV = "PAGEDLLM_TWO"\nC = envs.PAGEDLLM_THREE\n'
            'D = "set PAGEDLLM_FOUR=1 to ..."\n')
    assert names_in_python(code) == {"PAGEDLLM_ONE", "PAGEDLLM_TWO", "PAGEDLLM_THREE"}
    shell = ('X="${PAGEDLLM_A:-1}"\necho $PAGEDLLM_B\nPAGEDLLM_C=1 python x.py\n'
             'FLAGS=-DPAGEDLLM_D=16\n# PAGEDLLM_E=1 in a comment\n')
    assert names_in_shell(shell) == {"PAGEDLLM_A", "PAGEDLLM_B", "PAGEDLLM_C"}


def test_every_name_read_is_in_the_table() -> None:
    read = names_read()
    assert "PAGEDLLM_CPU_KERNELS" in read and "PAGEDLLM_CI_LEGS" in read  # the scan works
    missing = {n: f for n, f in read.items() if n not in envs.ENV_VARS}
    assert not missing, (f"PAGEDLLM_* names read but missing from pagedllm/envs.py's table "
                         f"(add them there, then run python tools/gen_env_docs.py): {missing}")


def test_every_entry_is_used() -> None:
    text = "\n".join(p.read_text(errors="replace") for p in [*python_files(), *shell_files()]
                     if p.name != "envs.py")
    unused = [n for n in envs.ENV_VARS if not re.search(rf"(?<![\w]){n}(?![\w])", text)]
    assert not unused, f"table entries nothing mentions (remove them): {unused}"


def test_docs_are_generated_from_the_table() -> None:
    spec = importlib.util.spec_from_file_location("gen_env_docs",
                                                  ROOT / "tools" / "gen_env_docs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    expected = tool.render(tool.load_envs())
    assert (ROOT / "docs" / "envs.md").read_text() == expected, \
        "docs/envs.md is stale: run python tools/gen_env_docs.py"
    for name in envs.ENV_VARS:
        assert f"`{name}`" in expected


def test_table_entries_are_consistent() -> None:
    for name, var in envs.ENV_VARS.items():
        assert name == var.name and NAME.fullmatch(name) and var.doc and "\n" not in var.doc
        assert var.default is None or isinstance(var.default, var.type), name
        assert var.scope in envs.SCOPES


def test_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_WORKER_THREADS", raising=False)
    assert envs.PAGEDLLM_WORKER_THREADS is None  # the default
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "3")
    assert envs.PAGEDLLM_WORKER_THREADS == 3 == envs.get("PAGEDLLM_WORKER_THREADS")
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", " ")
    assert envs.PAGEDLLM_WORKER_THREADS is None and not envs.is_set("PAGEDLLM_WORKER_THREADS")
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NOT_A_VARIABLE  # noqa: B018
    with pytest.raises(KeyError, match="PAGEDLLM_NOT_A_VARIABLE is not in"):
        envs.get("PAGEDLLM_NOT_A_VARIABLE")


@pytest.mark.parametrize("raw", ["1", "true", "YES", " On "])
def test_on(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_VERBOSE_BUILD", raw)
    assert envs.PAGEDLLM_VERBOSE_BUILD is True


@pytest.mark.parametrize("raw", ["0", "False", "no", "OFF"])
def test_off(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", raw)
    assert envs.PAGEDLLM_CPU_KERNELS is False


@pytest.mark.parametrize("name,raw,allowed", [
    ("PAGEDLLM_CPU_KERNELS", "2", "allowed values are 1, true, yes, on (on) or 0, false, no, off"),
    ("PAGEDLLM_CPU_QUANT_LOWP_MODE", "int4", "allowed values are none, int8"),
    ("PAGEDLLM_WORKER_THREADS", "0", "must be an integer >= 1"),
    ("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "soon", "must be a number > 0"),
])
def test_bad_value_names_variable_value_and_allowed(name: str, raw: str, allowed: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r} is invalid: {allowed}")):
        envs.get(name)


# import every module of the package with os.environ recording the PAGEDLLM_* keys it is asked
# for; modules whose optional dependencies are missing (torch_xla, ray, ...) are skipped
_IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys
asked = []
get = os._Environ.__getitem__
def recording(self, key):
    caller = sys._getframe(1)
    if caller.f_code.co_name in ("get", "__contains__"):  # Mapping.get / `in`: who called it
        caller = caller.f_back
    elif caller.f_code.co_filename.endswith("_collections_abc>"):
        return get(self, key)  # iterating over all of os.environ (a copy), not a read
    if isinstance(key, str) and "PAGEDLLM_" in key:
        asked.append((key, caller.f_code.co_filename, caller.f_lineno))
    return get(self, key)
os._Environ.__getitem__ = recording
import pagedllm
for info in pkgutil.walk_packages(pagedllm.__path__, "pagedllm."):
    if ".testing.test_" in info.name:
        continue  # conformance test modules: collected by pytest, not imported
    try:
        importlib.import_module(info.name)
    except ImportError:
        pass
print(json.dumps(asked))
"""


def test_importing_pagedllm_reads_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S": "5", "PAGEDLLM_GUIDED_OVERLAP": "1",
           "PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT": "7", "TOKENIZERS_PARALLELISM": "false"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    asked = json.loads(out.stdout.strip().splitlines()[-1])
    assert asked == [], f"read at import time: {asked}"
