"""The stability promise, checked: pagedllm/contract/manifest.json agrees with the code
(tools/contract_manifest.py), the old import paths reach the same objects, and the checker
itself refuses what the compatibility rule forbids."""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from pagedllm.contract.version import (PLUGIN_API_VERSION, PluginAPIDeprecationWarning,
                                       warn_deprecated)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "contract_manifest.py"


@pytest.fixture(scope="module")
def tool():
    """tools/contract_manifest.py (a script, not a package), by file path."""
    spec = importlib.util.spec_from_file_location("contract_manifest", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_manifest_agrees_with_the_code(tool) -> None:
    manifest = json.loads(tool.MANIFEST.read_text())
    problems = tool.check(tool.collect(), tool.collect_aliases(), manifest, PLUGIN_API_VERSION)
    assert not problems, "pagedllm/contract/manifest.json and the code differ:\n" + "\n".join(
        problems)


def test_manifest_file_is_in_its_written_form(tool) -> None:
    """What --write produces (one line per member), so a review reads one line per change."""
    manifest = json.loads(tool.MANIFEST.read_text())
    assert tool.MANIFEST.read_text() == tool.dumps(manifest)


def test_old_import_paths_keep_working() -> None:
    """What plugins written for 1.0-2.0 import (examples/oot_backend_api2.0, docs/porting.md)."""
    from pagedllm.backends import PLUGIN_API_VERSION as old_version
    from pagedllm.backends.attention import AttentionImpl, AttentionMetadata
    from pagedllm.backends.interface import Backend, CacheOps, Capabilities
    from pagedllm.backends.registry import discover, resolve_backend
    from pagedllm.contract import attention, backend, cache_ops, capabilities, registry

    assert old_version == PLUGIN_API_VERSION
    assert (AttentionImpl, AttentionMetadata) == (attention.AttentionImpl,
                                                  attention.AttentionMetadata)
    assert (Backend, CacheOps, Capabilities) == (backend.Backend, cache_ops.CacheOps,
                                                 capabilities.Capabilities)
    assert (discover, resolve_backend) == (registry.discover, registry.resolve_backend)


def test_the_checker_refuses_what_the_rule_forbids(tool) -> None:
    old = {"m.f": {"kind": "function", "signature": "(a: 'int', b: 'int' = 1) -> 'int'",
                   "since": "2.0"},
           "m.NAMES": {"kind": "constant", "signature": "('x', 'y')", "since": "2.0"},
           "m.C.flag": {"kind": "field", "signature": "bool = False", "since": "2.0"}}
    manifest = {"plugin_api_version": "2.1", "members": old, "aliases": {}, "deprecated": []}

    def problems(**changes: str) -> list[str]:
        code = {n: {"kind": e["kind"], "signature": changes.get(n, e["signature"])}
                for n, e in old.items() if changes.get(n) != "gone"}
        return tool.check(code, {}, manifest, "2.1")

    assert problems() == []
    # a new optional parameter and a grown tuple are compatible, yet must be recorded
    added = problems(**{"m.f": "(a: 'int', b: 'int' = 1, c: 'int' = 0) -> 'int'",
                        "m.NAMES": "('x', 'y', 'z')"})
    assert len(added) == 2 and all("compatible (run" in p for p in added)
    # a new required parameter, a renamed one, a changed default, a shrunk tuple are not
    for change in [{"m.f": "(a: 'int', b: 'int' = 1, c: 'int') -> 'int'"},
                   {"m.f": "(x: 'int', b: 'int' = 1) -> 'int'"},
                   {"m.f": "(a: 'int', b: 'int' = 2) -> 'int'"},
                   {"m.NAMES": "('x',)"}, {"m.C.flag": "bool = True"}]:
        found = problems(**change)
        assert len(found) == 1 and "INCOMPATIBLE" in found[0], (change, found)
    # removal: refused without a deprecation, and before the version the deprecation names
    assert "without a deprecation" in problems(**{"m.f": "gone"})[0]
    manifest["deprecated"] = [{"name": "m.f", "since": "2.1", "removed_in": "3.0",
                               "use": "m.g"}]
    assert "deprecated until 3.0" in problems(**{"m.f": "gone"})[0]
    assert tool.check({n: e for n, e in old.items() if n != "m.f"}, {}, manifest, "3.0") \
        == ["the manifest is for plugin API 2.1, the code's PLUGIN_API_VERSION is 3.0"]
    # a member the manifest lacks, and a since newer than the code
    code = {n: {"kind": e["kind"], "signature": e["signature"]} for n, e in old.items()}
    code["m.h"] = {"kind": "function", "signature": "() -> 'None'"}
    manifest["deprecated"] = []
    assert [p.split(" is new")[0] for p in tool.check(code, {}, manifest, "2.1")] == ["m.h"]
    old["m.f"]["since"] = "2.2"
    assert any("since='2.2'" in p for p in problems())


def test_write_records_compatible_changes_and_refuses_breaking_ones(tool) -> None:
    manifest = {"plugin_api_version": "2.0", "aliases": {}, "deprecated": [], "members": {
        "m.f": {"kind": "function", "signature": "(a: 'int') -> 'int'", "since": "1.0"}}}
    code = {"m.f": {"kind": "function", "signature": "(a: 'int', *, b: 'int' = 0) -> 'int'"},
            "m.g": {"kind": "function", "signature": "() -> 'None'"}}
    written = tool.write(code, {}, manifest, "2.1")
    assert written["members"]["m.f"] == {**code["m.f"], "since": "1.0"}
    assert written["members"]["m.g"] == {**code["m.g"], "since": "2.1"}
    assert tool.check(code, {}, written, "2.1") == []
    with pytest.raises(ValueError, match="m.f"):
        tool.write({"m.f": {"kind": "function", "signature": "(b: 'int') -> 'int'"}}, {},
                   manifest, "2.1")
    with pytest.raises(ValueError, match="removed without deprecation: m.f"):
        tool.write({}, {}, manifest, "2.1")


def test_deprecation_warning_names_the_member_and_the_version() -> None:
    with pytest.warns(PluginAPIDeprecationWarning,
                      match=r"Backend\.old_hook is deprecated since plugin API 2\.1 and is "
                            r"removed in 3\.0; use Backend\.new_hook"):
        warn_deprecated("Backend.old_hook", "2.1", "3.0", "Backend.new_hook")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DeprecationWarning: pytest and -W error show it
        with pytest.raises(DeprecationWarning):
            warn_deprecated("x", "2.1", "3.0", "y")
