"""pytest imports test modules by basename (rootdir-relative, no packages): two test files with one
name in different folders stop the whole run at collection."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def test_test_file_names_are_unique() -> None:
    root = Path(__file__).parent
    seen: dict[str, list[str]] = defaultdict(list)
    for path in root.rglob("test_*.py"):
        if "__init__.py" not in {p.name for p in path.parent.iterdir()}:
            seen[path.name].append(str(path.relative_to(root)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
