"""README.md and docs/ against the tool's own output (issue 40 item 7, issue 42 item 7).

* README's model table is generated from the model registry and the built-in backends' declared
  attention features (``python tests/test_docs.py --write`` rewrites it); ``pagedllm models``
  prints the same architectures; no document names an architecture the registry lacks.
* The backend lists (README's ``--device`` choices, docs/backends.md's table and auto order) are
  the registry's, and each capability column of docs/backends.md's table is what ``pagedllm
  backends --json`` reports the backend declares.
* README's first completion is what its command prints; the cpu step budget README states is the
  backend's and ``--help`` says it; no placeholder is left and every repository path the docs
  name exists.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BACKENDS_DOC = ROOT / "docs" / "backends.md"
CHECKED_DOCS = [README, BACKENDS_DOC, ROOT / "docs" / "architecture.md",
                ROOT / "docs" / "adding_a_model.md", ROOT / "docs" / "containers.md",
                ROOT / "pagedllm" / "models" / "demo_model" / "README.md"]
MODELS_BEGIN = ("<!-- the model table: generated from pagedllm/models/registry.py and the built-in "
                "backends' capabilities by `python tests/test_docs.py --write` -->")
MODELS_END = "<!-- end of the model table -->"
ARCH_NAME = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:ForCausalLM|LMHeadModel)\b")
# class names the docs use that are not architectures: transformers' auto class, the how-to's
# example family (docs/adding_a_model.md)
NOT_ARCHITECTURES = {"AutoModelForCausalLM", "MyFamilyForCausalLM"}


def _cli(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


def builtin_backends() -> dict[str, type]:
    from pagedllm.contract.registry import BUILTIN_BACKENDS, load_class

    return {name: load_class(target) for name, target in BUILTIN_BACKENDS.items()}


def models_markdown() -> str:
    """README's model table: each architecture, the attention features its configs can turn
    on, the built-in backends that run every config, and those that run it only without them."""
    from pagedllm.models.registry import MODEL_REGISTRY

    backends = builtin_backends()
    lines = ["| architecture | attention features its configs can turn on | runs on | "
             "only configs without them on |", "|---|---|---|---|"]
    for arch in sorted(MODEL_REGISTRY):
        features = set(MODEL_REGISTRY[arch].features)
        full = [n for n, cls in backends.items()
                if features <= set(cls.capabilities.attention_features)]
        partial = [n for n in backends if n not in full]
        lines.append(f"| `{arch}` | {', '.join(sorted(features)) or '–'} | "
                     f"{', '.join(full) or 'none'} | {', '.join(partial) or '–'} |")
    return "\n".join(lines)


def _models_block(text: str) -> str:
    assert MODELS_BEGIN in text and MODELS_END in text, "README lost its model-table markers"
    return text.split(MODELS_BEGIN, 1)[1].split(MODELS_END, 1)[0].strip()


def write_models_table() -> None:
    text = README.read_text()
    README.write_text(text.replace(_models_block(text), models_markdown()))


# --- models -------------------------------------------------------------------------------

def test_readme_model_table_is_the_registrys() -> None:
    assert _models_block(README.read_text()) == models_markdown(), (
        "README's model table is stale: run `python tests/test_docs.py --write`")


def test_pagedllm_models_prints_the_registry() -> None:
    from pagedllm.models.registry import MODEL_REGISTRY

    rows = [line.split()[0] for line in _cli("models").splitlines()[2:] if line.strip()]
    assert rows == sorted(MODEL_REGISTRY)


@pytest.mark.parametrize("doc", CHECKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_registered_architectures(doc: Path) -> None:
    from pagedllm.models.registry import MODEL_REGISTRY

    named = set(ARCH_NAME.findall(doc.read_text())) - NOT_ARCHITECTURES
    assert named <= set(MODEL_REGISTRY), f"not registered: {sorted(named - set(MODEL_REGISTRY))}"


# --- backends -----------------------------------------------------------------------------

def test_readme_device_choices_are_the_registrys() -> None:
    match = re.search(r"`--device (auto(?:\|[a-z<>]+)+)`", README.read_text())
    assert match, "README lost its `--device auto|...` line"
    assert set(match.group(1).split("|")) == {"auto", "<plugin>", *builtin_backends()}


def test_backends_doc_auto_order_is_the_registrys() -> None:
    from pagedllm.contract.registry import AUTO_ORDER

    match = re.search(r"takes the first available of ([a-z, ]+), then installed plugins, then cpu",
                      " ".join(BACKENDS_DOC.read_text().split()))
    assert match, "docs/backends.md lost its sentence on --device auto"
    assert [n.strip() for n in match.group(1).split(",")] == list(AUTO_ORDER)


def _doc_table() -> dict[str, dict[str, str]]:
    """docs/backends.md's capability table: backend name -> column -> cell."""
    lines = [line for line in BACKENDS_DOC.read_text().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    table = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(header) or set(cells[0]) <= {"-"}:
            continue
        table[cells[0].split()[0]] = dict(zip(header, cells))
    return table


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _flag(cell: str) -> bool:
    cell = cell.strip("*").lower()
    assert cell in ("yes", "no", "–") or cell.endswith("graphs") or cell.startswith("–"), cell
    return cell == "yes" or cell.endswith("graphs")


def _check_row(row: dict[str, str], caps: dict, device: str) -> None:
    assert row["torch device"].split()[0].strip("`") == device
    assert {d.strip() for d in row["dtypes"].split(",")} == {_SHORT[d] for d in caps["dtypes"]}
    cell = re.fullmatch(r"(?P<sizes>.+?)(?: \((?P<preferred>\d+)\))?",
                        row["block sizes (preferred)"])
    if cell["preferred"] is not None:
        assert int(cell["preferred"]) == caps["preferred_block_size"]
    if "–" in cell["sizes"]:  # a range: its ends
        low, high = (int(x) for x in cell["sizes"].split("–"))
        assert (min(caps["block_sizes"]), max(caps["block_sizes"])) == (low, high)
    else:
        assert [int(x) for x in cell["sizes"].split(",")] == caps["block_sizes"]
    for column, key in (("graphs", "graphs"), ("swap", "swap"), ("static shapes", "static_shapes"),
                        ("prefix caching", "prefix_caching"),
                        ("chunked prefill", "chunked_prefill")):
        assert _flag(row[column]) == caps[key], (column, row[column], caps[key])


def test_backends_doc_table_is_what_the_backends_declare() -> None:
    """Every built-in backend has a row, and each capability column says what ``pagedllm
    backends --json`` reports; the example plugin's row is its class's declaration."""
    table = _doc_table()
    reported = {b["name"]: b for b in json.loads(_cli("backends", "--json"))}
    for name in builtin_backends():
        assert name in table, f"docs/backends.md has no row for {name}"
        row = table[name]
        try:
            _check_row(row, reported[name]["capabilities"], reported[name]["torch_device"])
        except AssertionError as exc:
            raise AssertionError(f"docs/backends.md, row {name}: {exc}") from exc
    sys.path.insert(0, str(ROOT / "examples" / "oot_backend"))
    try:
        from pagedllm_toyaccel.backend import ToyAccelBackend
    finally:
        sys.path.pop(0)
    caps = ToyAccelBackend.capabilities
    _check_row(table["toyaccel"], dict(
        dtypes=list(caps.dtypes), block_sizes=list(caps.block_sizes),
        preferred_block_size=caps.preferred_block_size, graphs=caps.graphs, swap=caps.swap,
        static_shapes=caps.static_shapes, prefix_caching=caps.prefix_caching,
        chunked_prefill=caps.chunked_prefill), ToyAccelBackend.torch_device)


# --- what README says the tool does ---------------------------------------------------------

def test_readme_completion_is_what_its_command_prints() -> None:
    """The set-up's ``pagedllm generate "def fibonacci(n):"`` prints README's block (the lines
    before its "..." and the closing line)."""
    text = README.read_text()
    assert 'pagedllm generate "def fibonacci(n):"' in text
    block = text.split("Its greedy completion", 1)[1].split("```", 2)[1].strip("\n").splitlines()
    assert block and block[-2] == "...", block
    printed = _cli("generate", "def fibonacci(n):").rstrip("\n").splitlines()
    assert printed[: len(block) - 2] == block[:-2] and printed[-1] == block[-1], printed


def test_cpu_step_budget_in_readme_and_help() -> None:
    from pagedllm.backends.cpu.backend import CPU_MAX_NUM_BATCHED_TOKENS
    from pagedllm.engine.arg_utils import EngineArgs
    import dataclasses

    budget = str(CPU_MAX_NUM_BATCHED_TOKENS)
    flat = " ".join(README.read_text().split())
    assert f"chunked prefill is on with a {budget}-token step budget" in flat
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(EngineArgs)}
    assert f"on cpu {budget}" in helps["max_num_batched_tokens"]
    assert "on cpu it is on" in helps["enable_chunked_prefill"]


_PLACEHOLDER = re.compile(r"^\s*[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\s*$", re.MULTILINE)
_PATH = re.compile(r"`((?:examples|docs|benchmarks|tools|tests|pagedllm|csrc|docker|\.ci)/"
                   r"[A-Za-z0-9_./-]*)`")


@pytest.mark.parametrize("doc", CHECKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_placeholder_and_every_named_path_exists(doc: Path) -> None:
    text = doc.read_text()
    assert not _PLACEHOLDER.findall(text), _PLACEHOLDER.findall(text)
    missing = sorted({p for p in _PATH.findall(text)
                      if not any(ROOT.glob(p.rstrip("/").replace("NAME", "*")))})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_architecture_doc_names_the_examples() -> None:
    """docs/architecture.md's examples/ line names only what is there."""
    line = next(l for l in (ROOT / "docs" / "architecture.md").read_text().splitlines()
                if l.startswith("examples/"))
    for name in re.findall(r"[a-z_]+\.py|oot_backend", line):
        assert (ROOT / "examples" / name).exists(), name


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_models_table()
        print(f"wrote the model table in {README}")
    else:
        sys.exit("usage: python tests/test_docs.py --write   (rewrites README's model table)")
