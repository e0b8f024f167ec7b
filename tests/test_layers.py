"""The import structure of pagedllm/: layers in a fixed order, imports only downward, no circles.

Reads every module's imports with ``ast`` (nothing is imported or run) and checks two rules:

* **layers**: each module belongs to one layer of ``LAYERS`` (lowest first); it may import its
  own layer and the layers below, never one above;
* **circles**: the graph of imports between modules has no cycle (strongly connected component
  of two or more modules).

Which imports count: every ``import``/``from ... import`` naming a pagedllm module, wherever it
stands: at module level, inside a function (a lazy import), and under ``if TYPE_CHECKING:``.
A lazy import defers the cost, not the dependency: the function cannot run without the other
module, so a cycle through it is a cycle of the design (and of the reader's understanding); a
``TYPE_CHECKING`` import ties the module to the other's definitions in the same way. What does
not count: names given to ``importlib`` as strings (the registry's ``"module:Class"`` tables,
``Backend.worker_class``): they are data a consumer resolves at run time, the plug-in mechanism
itself (tests/contract/test_contract.py checks that each built-in string resolves). The implicit
import of a parent package (``import a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``) is
not an edge of the importing module; each ``__init__.py`` is a module whose own imports are
checked.

``python tests/test_layers.py`` prints the counts and every offending import.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

# Lowest first. An entry is a module ("pagedllm.config"), a package with everything below it
# ("pagedllm.core.*"), or a package's own __init__ ("pagedllm.backends"); the longest match wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("pagedllm.version", "pagedllm.logger", "pagedllm.envs", "pagedllm.config",
                    "pagedllm.sampling_params", "pagedllm.outputs", "pagedllm.spec_decode.config",
                    "pagedllm.lora", "pagedllm.lora.config", "pagedllm.lora.request",
                    "pagedllm.kv_offload", "pagedllm.kv_offload.config",
                    "pagedllm.kv_transfer", "pagedllm.kv_transfer.config")),
    # the plugin contract, and the old import paths plugins use (re-export modules)
    ("contract", ("pagedllm.contract.*", "pagedllm.backends", "pagedllm.backends.interface",
                  "pagedllm.backends.attention", "pagedllm.backends.registry")),
    # torch reference implementations of the ops and of paged attention
    ("reference", ("pagedllm.reference.*",)),
    # device-free bookkeeping; the process-group handles models shard over
    ("core", ("pagedllm.core.*", "pagedllm.distributed.parallel_state",
              # KV connectors' and offload tiers' scheduler side: content keys, no torch
              "pagedllm.kv_transfer.keys", "pagedllm.kv_transfer.base",
              "pagedllm.kv_transfer.scheduler_side", "pagedllm.kv_transfer.shared_storage",
              "pagedllm.kv_offload.tiers",
              "pagedllm.kv_offload.manager")),
    ("models", ("pagedllm.models.*",)),
    # the device side of a step; speculative decoding's proposers and LoRA's adapters run beside it
    ("worker", ("pagedllm.worker.*", "pagedllm.spec_decode.*", "pagedllm.lora.*",
                # the data movement of KV connectors and offload tiers
                "pagedllm.kv_transfer.*", "pagedllm.kv_offload.*")),
    # the built-in backends: implementations of the contract, composing worker and models
    ("backends", ("pagedllm.backends.*",)),
    ("executor", ("pagedllm.executor.*", "pagedllm.distributed.*")),
    ("engine", ("pagedllm.engine.*", "pagedllm.lora.registry",
                # connectors by name (entry points) and the engine's hooks
                "pagedllm.kv_transfer.registry", "pagedllm.kv_transfer.engine")),
    ("api", ("pagedllm", "pagedllm.entrypoints.*", "pagedllm.testing.*")),
]
# compiled extension modules (no .py source): an import of one is an import of nothing here
NATIVE = {"pagedllm._C"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported pagedllm module
    line: int
    kind: str  # "top" | "lazy" (inside a function) | "typing" (under TYPE_CHECKING)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` denotes: itself, or the longest known prefix (an attribute import)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known or candidate in NATIVE:
            return candidate
        parts.pop()
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every pagedllm import in one module, with where it stands."""
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, kind: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    yield from walk_stmt(stmt, "typing")
                for stmt in child.orelse:
                    yield from walk_stmt(stmt, kind)
            else:
                yield from walk_stmt(child, kind)

    def walk_stmt(node: ast.AST, kind: str) -> Iterator[Import]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from walk(node, "typing" if kind == "typing" else "lazy")
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            # "from a import b" imports module a.b when there is one, else names of a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known.keys() | NATIVE
                       else base for alias in node.names]
        for target in targets:
            module = _resolve(target, known) if target.startswith("pagedllm") else None
            if module is not None and module != name and module not in NATIVE:
                yield Import(name, module, node.lineno, kind)
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from walk(node, kind)

    yield from walk(ast.parse(path.read_text(), str(path)), "top")


def import_graph(package: Path = PACKAGE) -> list[Import]:
    """All imports between pagedllm modules; one per (source, target), the strongest kind."""
    known = modules(package)
    rank = {"top": 0, "lazy": 1, "typing": 2}
    best: dict[tuple[str, str], Import] = {}
    for name, path in known.items():
        for imp in imports_of(name, path, known):
            key = (imp.source, imp.target)
            if key not in best or rank[imp.kind] < rank[best[key].kind]:
                best[key] = imp
    return sorted(best.values(), key=lambda i: (i.source, i.target))


def layer_of(module: str) -> int:
    """Index into LAYERS of the longest entry matching ``module``."""
    best, best_len = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith(".*"):
                prefix = entry[:-2]
                hit = module == prefix or module.startswith(prefix + ".")
                length = len(prefix) + 1
            else:
                hit, length = module == entry, len(entry) + 2  # exact beats a package pattern
            if hit and length > best_len:
                best, best_len = index, length
    if best is None:
        raise LookupError(f"module {module} is in no layer of LAYERS; add it where it belongs")
    return best


def upward_imports(graph: list[Import]) -> list[Import]:
    return [imp for imp in graph if layer_of(imp.target) > layer_of(imp.source)]


def circles(graph: list[Import]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan, iterative)."""
    succ: dict[str, list[str]] = {}
    for imp in graph:
        succ.setdefault(imp.source, []).append(imp.target)
        succ.setdefault(imp.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in succ:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _describe(imp: Import) -> str:
    return (f"{imp.source} ({LAYERS[layer_of(imp.source)][0]}) imports {imp.target} "
            f"({LAYERS[layer_of(imp.target)][0]}) at line {imp.line} [{imp.kind}]")


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)  # raises, naming the module


def test_no_import_runs_up_the_layers() -> None:
    up = upward_imports(import_graph())
    assert not up, ("imports running up the layers (LAYERS in tests/test_layers.py):\n"
                    + "\n".join(map(_describe, up)))


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines += ["    " + _describe(i) for i in graph
                  if i.source in members and i.target in members]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_the_contract_depends_only_on_config_torch_and_itself() -> None:
    """pagedllm.contract imports pagedllm.config, the environment table (pagedllm.envs), torch,
    the standard library and itself: nothing a plugin would not already have."""
    allowed = {"pagedllm.config", "pagedllm.envs"}
    bad = [_describe(i) for i in import_graph() if i.source.startswith("pagedllm.contract")
           and not i.target.startswith("pagedllm.contract") and i.target not in allowed]
    for name, path in modules().items():
        if not name.startswith("pagedllm.contract"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                     and node.module else [])
            bad += [f"{name} imports {r}" for r in roots
                    if r.split(".")[0] not in sys.stdlib_module_names | {"torch", "pagedllm"}]
    assert not bad, "the contract imports more than config, envs, torch and itself:\n" + \
        "\n".join(bad)


# old import paths kept for plugins written against them (re-export modules): in-tree code
# imports the module that defines the name
OLD_PATHS = {
    "pagedllm.backends.interface": "pagedllm.contract.backend / .capabilities / .cache_ops / "
                                   ".attention / .registry",
    "pagedllm.backends.attention": "pagedllm.contract.attention",
    "pagedllm.backends.registry": "pagedllm.contract.registry",
    "pagedllm.models.layers.ops": "pagedllm.reference.ops",
    "pagedllm.models.layers.moe_ops": "pagedllm.reference.moe",
    "pagedllm.models.layers.quantization.reference": "pagedllm.reference.quant",
    "pagedllm.backends.cpu.attention": "pagedllm.reference.attention",
}


def test_in_tree_code_imports_the_contract_by_its_own_paths() -> None:
    old = [i for i in import_graph() if i.target in OLD_PATHS and i.source not in OLD_PATHS]
    assert not old, "in-tree imports of the old paths (kept for plugins only):\n" + "\n".join(
        f"{i.source} line {i.line}: {i.target} -> {OLD_PATHS[i.target]}" for i in old)


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader itself: top-level, relative, lazy and TYPE_CHECKING imports are all edges, and
    an upward one and a circle are found (so the rules above can fail)."""
    pkg = tmp_path / "pagedllm"
    (pkg / "core").mkdir(parents=True)
    (pkg / "engine").mkdir()
    for init in (pkg, pkg / "core", pkg / "engine"):
        (init / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from pagedllm.core import a\n")
    (pkg / "core" / "a.py").write_text("from . import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    import pagedllm.engine.c\n")
    (pkg / "engine" / "c.py").write_text("from pagedllm.core.a import X\nfrom pagedllm import _C\n")
    graph = import_graph(pkg)
    kinds = {(i.source, i.target): i.kind for i in graph}
    assert kinds == {("pagedllm.config", "pagedllm.core.a"): "typing",
                     ("pagedllm.core.a", "pagedllm.core.b"): "top",
                     ("pagedllm.core.b", "pagedllm.engine.c"): "lazy",
                     ("pagedllm.engine.c", "pagedllm.core.a"): "top"}
    assert circles(graph) == [["pagedllm.core.a", "pagedllm.core.b", "pagedllm.engine.c"]]
    assert {(i.source, i.target) for i in upward_imports(graph)} == {
        ("pagedllm.config", "pagedllm.core.a"), ("pagedllm.core.b", "pagedllm.engine.c")}


def report() -> str:
    graph = import_graph()
    up, found = upward_imports(graph), circles(graph)
    lines = [f"{len(modules())} modules, {len(graph)} imports between them; "
             f"{len(up)} run up the layers, {len(found)} circles"]
    lines += ["up: " + _describe(i) for i in up]
    lines += ["circle: " + " <-> ".join(c) for c in found]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
    sys.exit(0)
