"""The OpenMP spin default (entrypoints/omp_env.py) of ``import pagedllm`` and the ``pagedllm``
command: set before torch loads libgomp, never over the user's choice, and seen by the engine
process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.entrypoints.omp_env import DEFAULT_SPINCOUNT, SPINCOUNT_ENV

_PROBE = """
{before}
import json, os, sys
from pagedllm.entrypoints.omp_env import set_spin_default
print(json.dumps({{"set": set_spin_default(), "value": os.environ.get("GOMP_SPINCOUNT")}}))
"""


def _probe(env_extra: dict[str, str], before: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (SPINCOUNT_ENV, "OMP_WAIT_POLICY")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(before=before)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_default_is_set_before_torch_loads() -> None:
    """``import pagedllm`` set it already (a second call finds it set)."""
    assert _probe({}) == {"set": False, "value": DEFAULT_SPINCOUNT}


@pytest.mark.parametrize("env_extra", [{SPINCOUNT_ENV: "300000"}, {"OMP_WAIT_POLICY": "active"}])
def test_the_users_policy_wins(env_extra: dict[str, str]) -> None:
    got = _probe(env_extra)
    assert got["set"] is False and got["value"] == env_extra.get(SPINCOUNT_ENV)


def test_too_late_once_torch_is_loaded() -> None:
    assert _probe({}, before="import torch") == {"set": False, "value": None}


def test_the_command_sets_it_for_what_it_runs(tmp_path) -> None:
    """``pagedllm backends`` runs in the command's process: the variable is there by then."""
    env = {k: v for k, v in os.environ.items() if k not in (SPINCOUNT_ENV, "OMP_WAIT_POLICY")}
    script = ("import os, sys; from pagedllm.entrypoints import cli; "
              "cli.run_command = lambda func, args: print('SPIN', os.environ.get('GOMP_SPINCOUNT'))"
              " or 0; cli.main(['backends'])")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert f"SPIN {DEFAULT_SPINCOUNT}" in res.stdout, res.stdout + res.stderr
