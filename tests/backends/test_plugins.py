"""Out-of-tree backends are found through real installed-distribution metadata.

Each fake plugin is a module plus a ``NAME-VERSION.dist-info`` folder (METADATA and
entry_points.txt) on a temporary path put on PYTHONPATH of a fresh interpreter, which is exactly
what ``importlib.metadata`` reads for a pip-installed package. One probe process records what
the registry, ``resolve_backend`` and ``pagedllm backends`` make of them under several
``PAGEDLLM_BACKENDS`` settings; the tests below assert on that record.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.contract.version import PLUGIN_API_VERSION

CPU_SUBCLASS = "from pagedllm.backends.cpu.backend import CpuBackend\n"
PLUGINS = {
    # dist name: (entry-point name, module name, module source)
    "plug-ok": ("okaccel", "plug_ok", CPU_SUBCLASS + textwrap.dedent("""
        class OkBackend(CpuBackend):
            name = "okaccel"
        """), "OkBackend"),
    "plug-off": ("offaccel", "plug_off", CPU_SUBCLASS + textwrap.dedent("""
        class OffBackend(CpuBackend):
            name = "offaccel"

            @classmethod
            def availability(cls):
                return False, "no offaccel card found (driver reports 0 devices)"
        """), "OffBackend"),
    "plug-broken": ("brokenaccel", "plug_broken",
                    'raise ImportError("libvendor.so: cannot open shared object file")\n',
                    "BrokenBackend"),
    "plug-notabackend": ("notabackend", "plug_notabackend", "class Thing:\n    pass\n", "Thing"),
    "plug-dup-a": ("dupaccel", "plug_dup_a",
                   CPU_SUBCLASS + "class A(CpuBackend):\n    name = 'dupaccel'\n", "A"),
    "plug-dup-b": ("dupaccel", "plug_dup_b",
                   CPU_SUBCLASS + "class B(CpuBackend):\n    name = 'dupaccel'\n", "B"),
    "plug-cpu-claim": ("cpu", "plug_cpu_claim",
                       CPU_SUBCLASS + "class C(CpuBackend):\n    pass\n", "C"),
    "plug-oldapi": ("oldaccel", "plug_oldapi", CPU_SUBCLASS + textwrap.dedent("""
        class OldBackend(CpuBackend):
            name = "oldaccel"
            plugin_api_version = "1.3"
        """), "OldBackend"),
    "plug-curapi": ("curaccel", "plug_curapi", CPU_SUBCLASS + textwrap.dedent("""
        class CurBackend(CpuBackend):
            name = "curaccel"
            plugin_api_version = "2.0"
        """), "CurBackend"),
    "plug-misnamed": ("misnamed", "plug_misnamed", CPU_SUBCLASS + textwrap.dedent("""
        class MisnamedBackend(CpuBackend):
            name = "othername"
        """), "MisnamedBackend"),
}
HEALTHY = "okaccel,offaccel,brokenaccel,notabackend,oldaccel,curaccel,misnamed"

PROBE = textwrap.dedent("""
    import argparse, contextlib, io, json, logging, os
    from pagedllm.backends import registry
    from pagedllm.entrypoints import backends_cmd

    logs = []
    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())
    logging.getLogger("pagedllm").addHandler(Keep())

    def attempt(fn):
        try:
            return {"value": fn()}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def use(plugins):
        if plugins is None:
            os.environ.pop("PAGEDLLM_BACKENDS", None)
        else:
            os.environ["PAGEDLLM_BACKENDS"] = plugins

    out = {}
    use(%(healthy)r)
    out["infos"] = {n: {"source": i.source, "loaded": i.cls is not None, "error": i.error,
                        "availability": list(i.availability())}
                    for n, i in registry.discover().items()}
    for name in ("okaccel", "offaccel", "brokenaccel", "notabackend", "auto"):
        out["resolve_" + name] = attempt(lambda: registry.resolve_backend(name).name)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        backends_cmd.run(argparse.Namespace())
    out["table"] = buf.getvalue()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        backends_cmd.run(argparse.Namespace(json=True, verbose=False))
    out["json"] = json.loads(buf.getvalue())
    use("offaccel")
    out["auto_without_available_plugin"] = attempt(lambda: registry.resolve_backend("auto").name)
    use("okaccel")
    out["only_ok"] = sorted(registry.discover())
    use("dupaccel")
    out["duplicate"] = attempt(lambda: sorted(registry.discover()))
    use("cpu")
    out["claims_builtin"] = attempt(lambda: sorted(registry.discover()))
    use(None)
    out["unfiltered"] = attempt(lambda: sorted(registry.discover()))
    out["logs"] = logs
    print("PROBE" + json.dumps(out))
""") % {"healthy": HEALTHY}


def install_fake_plugins(site: Path, names: list[str]) -> None:
    """Write each plugin's module and its dist-info (as pip would) under ``site``."""
    for dist in names:
        ep_name, module, source, attr = PLUGINS[dist]
        (site / f"{module}.py").write_text(source)
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(
            f"[pagedllm.backends]\n{ep_name} = {module}:{attr}\n")


def run_python(code: str, site: Path, timeout: float = 300, **env: str) -> str:
    full_env = dict(os.environ, **env)
    paths = [str(site), full_env.get("PYTHONPATH", "")]
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site-packages")
    install_fake_plugins(site, list(PLUGINS))
    return site


@pytest.fixture(scope="module")
def probe(plugin_site: Path) -> dict:
    stdout = run_python(PROBE, plugin_site)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE"):])


def test_installed_plugin_is_listed_with_its_package(probe: dict) -> None:
    ok = probe["infos"]["okaccel"]
    assert ok["source"] == "plug-ok" and ok["loaded"] and ok["availability"][0] is True
    assert probe["infos"]["cpu"]["source"] == "built-in"


def test_device_name_selects_the_plugin(probe: dict) -> None:
    assert probe["resolve_okaccel"] == {"value": "okaccel"}


def test_auto_considers_plugins_before_cpu(probe: dict) -> None:
    assert probe["resolve_auto"] == {"value": "okaccel"}
    assert probe["auto_without_available_plugin"] == {"value": "cpu"}


def test_unavailable_plugin_gives_its_reason(probe: dict) -> None:
    off = probe["infos"]["offaccel"]
    assert off["loaded"] and off["availability"] == [False, "no offaccel card found (driver "
                                                            "reports 0 devices)"]
    err = probe["resolve_offaccel"]["error"]
    assert "no offaccel card found" in err and "Available here:" in err and "okaccel" in err


def test_broken_plugin_is_reported_and_others_still_work(probe: dict) -> None:
    broken = probe["infos"]["brokenaccel"]
    assert broken["source"] == "plug-broken" and not broken["loaded"]
    assert "ImportError: libvendor.so: cannot open shared object file" in broken["error"]
    assert "libvendor.so" in probe["resolve_brokenaccel"]["error"]
    assert any("brokenaccel" in m and "plug-broken" in m and "failed to load" in m
               for m in probe["logs"]), probe["logs"]
    notabackend = probe["infos"]["notabackend"]
    assert not notabackend["loaded"] and "not a pagedllm Backend subclass" in notabackend["error"]
    assert probe["resolve_okaccel"] == {"value": "okaccel"}  # the healthy ones are unaffected
    assert probe["infos"]["cpu"]["availability"][0] is True


def test_two_packages_claiming_one_name_is_an_error_naming_both(probe: dict) -> None:
    err = probe["duplicate"]["error"]
    assert err.startswith("RuntimeError") and "'dupaccel'" in err
    assert "plug-dup-a" in err and "plug-dup-b" in err, err


def test_plugin_claiming_a_builtin_name_is_an_error(probe: dict) -> None:
    err = probe["claims_builtin"]["error"]
    assert "'cpu'" in err and "built-in" in err and "plug-cpu-claim" in err, err


def test_pagedllm_backends_env_limits_which_plugins_load(probe: dict) -> None:
    assert "okaccel" in probe["only_ok"]
    assert not {"offaccel", "brokenaccel", "dupaccel"} & set(probe["only_ok"])
    assert "cpu" in probe["only_ok"]  # built-ins are not filtered
    # without the filter every installed plugin loads, so the duplicate name surfaces
    assert "claimed by two packages" in probe["unfiltered"]["error"]


def test_backends_table_lists_plugins_with_status(probe: dict) -> None:
    rows = {ln.split()[0]: ln for ln in probe["table"].splitlines()[2:] if ln.strip()}
    assert {"cpu", "okaccel", "offaccel", "brokenaccel"} <= set(rows)
    assert "plug-ok" in rows["okaccel"] and "available" in rows["okaccel"]
    assert "swap,prefix_caching,chunked_prefill" in rows["okaccel"] and "float32" in rows["okaccel"]
    assert "unavailable: no offaccel card found" in rows["offaccel"]
    assert "failed to load: ImportError: libvendor.so" in rows["brokenaccel"]


def test_incompatible_plugin_api_major_is_refused_with_the_reason(probe: dict) -> None:
    old = probe["infos"]["oldaccel"]
    assert not old["loaded"] and old["availability"][0] is False
    reason = old["availability"][1]
    assert reason.startswith("refused: written for plugin API 1.3") and \
        f"implements {PLUGIN_API_VERSION}" in reason, reason
    rows = {ln.split()[0]: ln for ln in probe["table"].splitlines()[2:] if ln.strip()}
    assert "refused: written for plugin API 1.3" in rows["oldaccel"]
    assert probe["resolve_okaccel"] == {"value": "okaccel"}  # others unaffected
    cur = probe["infos"]["curaccel"]
    assert cur["loaded"] and cur["availability"][0] is True
    facts = {f["name"]: f for f in probe["json"]}
    assert facts["curaccel"]["plugin_api_version"] == "2.0"  # a minor older than ours: loads
    assert facts["okaccel"]["plugin_api_version"] is None  # not stated: accepted, shown as such
    assert facts["cpu"]["plugin_api_version"] == PLUGIN_API_VERSION
    assert facts["cpu"]["capabilities"]["swap"]


def test_entry_point_name_must_equal_backend_name(probe: dict) -> None:
    bad = probe["infos"]["misnamed"]
    assert not bad["loaded"], bad
    assert "'misnamed'" in bad["error"] and "'othername'" in bad["error"], bad["error"]
    assert "othername" not in probe["infos"]


def test_llm_runs_on_an_installed_plugin(tmp_path: Path, llama_path: str) -> None:
    """`LLM(device=NAME)` and `device="auto"` run a plugin end to end; pagedllm is unchanged."""
    site = tmp_path / "site"
    site.mkdir()
    install_fake_plugins(site, ["plug-ok"])
    code = textwrap.dedent(f"""
        from pagedllm import LLM, SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for device in ("okaccel", "auto"):
            llm = LLM({llama_path!r}, device=device, dtype="float32", max_model_len=64)
            out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], params, use_tqdm=False)
            print("RESULT", device, llm.llm_engine.backend.name, out[0].outputs[0].token_ids)
        """)
    # the filter keeps any other installed plugin (e.g. the example) out of "auto"'s choice
    stdout = run_python(code, site, PAGEDLLM_BACKENDS="okaccel")
    results = [ln.split(maxsplit=3) for ln in stdout.splitlines() if ln.startswith("RESULT")]
    assert [(r[1], r[2]) for r in results] == [("okaccel", "okaccel"), ("auto", "okaccel")]
    assert results[0][3] == results[1][3] and len(json.loads(results[0][3])) == 4


def test_example_package_when_installed() -> None:
    """The examples/oot_backend package, once pip-installed (.ci/leg_oot.sh does), is found."""
    pytest.importorskip("pagedllm_toyaccel", reason="examples/oot_backend is not installed here")
    from pagedllm.backends.registry import discover, resolve_backend

    info = discover()["toyaccel"]
    assert info.source == "pagedllm-toyaccel" and info.availability()[0]
    assert resolve_backend("toyaccel").capabilities.static_shapes


def test_cli_backends_command_lists_plugins(plugin_site: Path) -> None:
    paths = [str(plugin_site), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PAGEDLLM_BACKENDS=HEALTHY,
               PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "backends"],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 2 and "invalid choice" in proc.stderr:
        pytest.skip("the pagedllm CLI has no `backends` subcommand yet")
    assert proc.returncode == 0, proc.stderr
    assert "okaccel" in proc.stdout and "plug-ok" in proc.stdout
    assert "failed to load: ImportError" in proc.stdout
