"""`pagedllm backends --verbose` (a real CLI subprocess): every capability has its meaning, and
the flag, value and meaning columns line up however long a value is (head sizes, quantization
methods)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from pagedllm.contract.capabilities import Capabilities
from pagedllm.entrypoints.backends_cmd import FLAG_HELP


def test_every_capability_has_a_meaning() -> None:
    missing = [f.name for f in dataclasses.fields(Capabilities) if not FLAG_HELP.get(f.name)]
    assert not missing, f"backends_cmd.FLAG_HELP lacks {missing}"


def test_verbose_columns_line_up() -> None:
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "backends",
                          "--verbose"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, COLUMNS="400"))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines()
            if line.startswith("  ") and line.split()[0] in FLAG_HELP]
    assert len(rows) >= len(FLAG_HELP), out.stdout  # a block per backend with capabilities
    value_columns, meaning_columns, longest = set(), set(), 0
    for line in rows:
        key = line.split()[0]
        value_at = len(line) - len(line[2 + len(key):].lstrip())
        meaning_at = line.rindex(FLAG_HELP[key])
        value_columns.add(value_at)
        meaning_columns.add(meaning_at)
        longest = max(longest, len(line[value_at:meaning_at].rstrip()))
        assert line[meaning_at - 2:meaning_at] == "  ", line  # a gap before the meaning
    assert len(value_columns) == 1 and len(meaning_columns) == 1, "\n".join(rows)
    assert longest > 28, "no value longer than the old fixed column (28) was listed"
