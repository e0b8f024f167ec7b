"""pytest plugin of the backend conformance suite (registered as a ``pytest11`` entry point).

    pytest --pyargs pagedllm.testing --device NAME      # any registered backend, plugins included

Adds ``--device`` (default: $PAGEDLLM_TEST_DEVICE or ``cpu``), the ``capability`` marker, the
``conformance_*`` fixtures, and a terminal summary of what the run covered. It only acts on tests
of the ``pagedllm.testing`` package, so loading it into any other pytest run changes nothing
there; it imports no torch (and no backend) until a conformance test asks for it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

from pagedllm import envs
from pagedllm.testing.report import NOT_DECLARED, CheckDims, Coverage, capability_label
from pagedllm.testing.space import DEFAULT_SEED, FULL, PAIRS, SWEEPS, VALUES, SweepChoice

if TYPE_CHECKING:
    import torch

    from pagedllm.contract.backend import Backend
    from pagedllm.contract.capabilities import Capabilities

SUITE_PREFIX = "pagedllm.testing."
DEFAULT_DEVICE = "cpu"
_COVERAGE = pytest.StashKey[Coverage]()
_BACKEND_CLS = pytest.StashKey["type[Backend] | None"]()
_SAMPLED_OUT = pytest.StashKey[set]()  # node ids --conformance-sample leaves out
_SWEEP = pytest.StashKey[SweepChoice]()
# capabilities read with a default (a Capabilities without the field declares the default)
OPTIONAL_CLAIMS = {"deterministic": True, "kv_export_layer_major": False}


# --- options and markers -------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedllm", "pagedllm backend conformance suite")
    help_text = ("backend the conformance suite checks (a name from `pagedllm backends`, "
                 f"default: $PAGEDLLM_TEST_DEVICE or {DEFAULT_DEVICE})")
    try:
        group.addoption("--device", "--pagedllm-device", dest="pagedllm_device", default=None,
                        help=help_text)
    except ValueError:  # another plugin owns --device; keep the long spelling
        group.addoption("--pagedllm-device", dest="pagedllm_device", default=None, help=help_text)
    group.addoption("--attention-backend", dest="pagedllm_attention_backend", default=None,
                    help="the backend's attention implementation to check (its attention_cls "
                         "choice, e.g. 'ipex' on cpu); sets $PAGEDLLM_ATTENTION_BACKEND for the "
                         "run. Default: the backend's own default")
    group.addoption("--conformance-report", dest="pagedllm_report", default=None,
                    metavar="PATH", help="write the run's results as JSON (commit, backend, "
                    "package version, each check's status with its max error and NMSE, the "
                    "PASS/FAIL/NOT DECLARED matrix); docs/porting.md describes the format")
    group.addoption("--conformance-sample", dest="pagedllm_sample", default=None, metavar="N",
                    help="run at most N cases of each check (raised where needed so every "
                    "declared parameter value runs once; the rest are reported SKIPPED, sampled "
                    "out). For slow, emulated backends. Default: $PAGEDLLM_CONFORMANCE_SAMPLE "
                    "or all")
    group.addoption("--conformance-sweep", dest="pagedllm_sweep", default=None,
                    choices=SWEEPS, help="which combinations of the declared space the swept "
                    "checks take (space.py): 'pairs' (default: every value of every dimension "
                    "with every value of every other), 'values' (each value once; the default "
                    "with --conformance-sample) or 'full' (all)")
    group.addoption("--conformance-full", dest="pagedllm_full", action="store_true",
                    help="run every combination of the declared space and every case of every "
                    "check (--conformance-sweep full, no --conformance-sample)")
    group.addoption("--conformance-seed", dest="pagedllm_seed", default=None, type=int,
                    metavar="N", help="seed of the swept checks' free choices (default "
                    f"{DEFAULT_SEED}; the run's header reports it)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "capability(*names): a conformance check that needs these backend "
        "capabilities (Capabilities fields, 'dtype:NAME', or 'cached_context' = prefix caching "
        "or chunked prefill); skipped, and reported, when the backend does not declare them")
    config.stash[_COVERAGE] = Coverage()
    seed = config.getoption("pagedllm_seed", None)
    config.stash[_SWEEP] = SweepChoice(sweep=_sweep_mode(config),
                                       seed=DEFAULT_SEED if seed is None else seed)
    attention = config.getoption("pagedllm_attention_backend", None)
    if attention:  # every EngineConfig of the run (and of its subprocesses) picks it up
        from pagedllm.config import ATTENTION_BACKEND_ENV

        os.environ[ATTENTION_BACKEND_ENV] = attention
    config.pluginmanager.register(_Recorder(config.stash[_COVERAGE]),
                                  "pagedllm-conformance-recorder")


def _sweep_mode(config: pytest.Config) -> str:
    """--conformance-sweep, else full with --conformance-full, values with a sample limit,
    else pairs."""
    explicit = config.getoption("pagedllm_sweep", None)
    if explicit:
        return explicit
    if config.getoption("pagedllm_full", False):
        return FULL
    from pagedllm.testing.sample import sample_limit

    try:
        limit = sample_limit(config.getoption("pagedllm_sample", None))
    except ValueError:  # reported by _sample with the option's name
        limit = None
    return VALUES if limit is not None else PAIRS


def device_name(config: pytest.Config) -> str:
    return (config.getoption("pagedllm_device", None) or envs.PAGEDLLM_TEST_DEVICE
            or DEFAULT_DEVICE).lower()


def _in_suite(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and module.__name__.startswith(SUITE_PREFIX)


# --- capabilities --------------------------------------------------------------------------
def has_capability(caps: Capabilities, name: str) -> bool:
    from pagedllm.testing.sweep import has_limit

    limit = has_limit(caps, name)  # head_size:N, gqa_group:N, feature:X, kv_cache:X
    if limit is not None:
        return limit
    if name.startswith("dtype:"):
        return name[6:] in caps.dtypes
    if name == "cached_context":  # prefill over KV already in the cache
        return caps.prefix_caching or caps.chunked_prefill
    if name in OPTIONAL_CLAIMS:  # fields newer than some contracts: their default applies
        return bool(getattr(caps, name, OPTIONAL_CLAIMS[name]))
    value = getattr(caps, name, None)
    if value is None:
        raise ValueError(f"unknown capability {name!r} in a capability marker")
    return bool(value)


def _backend_class(config: pytest.Config) -> type[Backend] | None:
    """The class registered under --device, or None when it is unknown or failed to load."""
    if _BACKEND_CLS not in config.stash:
        try:
            from pagedllm.contract.registry import discover

            info = discover().get(device_name(config))
            config.stash[_BACKEND_CLS] = info.cls if info is not None else None
        except Exception:  # reported by _check_backend with the registry's own message
            config.stash[_BACKEND_CLS] = None
    return config.stash[_BACKEND_CLS]


def _check_backend(config: pytest.Config) -> None:
    """Stop the run at once, with the registry's reason, when --device cannot run here."""
    from pagedllm.contract.registry import discover

    name = device_name(config)
    try:
        infos = discover()
    except RuntimeError as exc:  # e.g. two packages claiming one name
        raise pytest.UsageError(f"--device {name}: {exc}") from exc
    info = infos.get(name)
    if info is None:
        raise pytest.UsageError(f"--device {name}: not a known backend; known: {', '.join(infos)}. "
                                "Is the plugin package installed in this environment?")
    ok, reason = info.availability()
    if not ok or info.cls is None:
        raise pytest.UsageError(f"--device {name} ({info.source}) is not available here: {reason}")
    caps = info.cls.capabilities
    from pagedllm.testing.harness import block_sizes_to_test

    declared = [f for f in ("graphs", "swap", "static_shapes", "prefix_caching", "chunked_prefill")
                if getattr(caps, f)]
    cov = config.stash[_COVERAGE]
    cov.backend, cov.source = name, info.source
    cov.info = _backend_facts(info.cls)
    cov.info["backend_plugin_api_version"] = info.extra.get("plugin_api_version")
    tested = block_sizes_to_test(caps.block_sizes, caps.preferred_block_size)
    from pagedllm.config import ATTENTION_BACKEND_ENV

    attention = envs.get(ATTENTION_BACKEND_ENV) or "default"
    cov.header = (f"backend {name!r} from {info.source}; torch device {info.cls.torch_device!r}; "
                  f"attention {attention}; plugin API "
                  f"{info.extra.get('plugin_api_version') or 'not stated'}; dtypes "
                  f"{', '.join(caps.dtypes)}; block sizes {', '.join(map(str, caps.block_sizes))}"
                  f" (all in the sweep; {', '.join(map(str, tested))} in the other checks); "
                  f"declares {', '.join(declared) or 'no optional capability'}")


# --- collection ----------------------------------------------------------------------------
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not metafunc.module.__name__.startswith(SUITE_PREFIX):
        return
    if "conformance_dtype" in metafunc.fixturenames:
        from pagedllm.testing.harness import ENGINE_DTYPES

        metafunc.parametrize("conformance_dtype", ENGINE_DTYPES)
    if "conformance_block_size" in metafunc.fixturenames:
        from pagedllm.testing.harness import block_sizes_to_test

        cls = _backend_class(metafunc.config)
        sizes = ([16] if cls is None else
                 block_sizes_to_test(cls.capabilities.block_sizes,
                                     cls.capabilities.preferred_block_size))
        metafunc.parametrize("conformance_block_size", sizes, ids=[f"bs{s}" for s in sizes])
    _parametrize_sweep(metafunc)
    if "sweep_case" in metafunc.fixturenames:
        _parametrize_space(metafunc)


def _parametrize_space(metafunc: pytest.Metafunc) -> None:
    """A swept check (its module's ``SPACES[name](caps, features, kv_cache_dtypes)``): the
    combinations of its declared space this run takes (space.py), one case each."""
    from pagedllm.contract.capabilities import Capabilities
    from pagedllm.testing.space import case_id

    cls = _backend_class(metafunc.config)
    caps = cls.capabilities if cls is not None else Capabilities()
    features, kv = caps.attention_features, caps.kv_cache_dtypes
    if cls is not None and os.environ.get("PAGEDLLM_ATTENTION_BACKEND"):
        from pagedllm.testing.sweep import FEATURE, KV_CACHE_DTYPE

        # the chosen implementation's own: a case it would skip is not worth a slot
        features = tuple(f for f in features if chosen_attention_supports(cls, FEATURE + f))
        kv = tuple(k for k in kv if k == "auto" or
                   chosen_attention_supports(cls, KV_CACHE_DTYPE + k))
    name = metafunc.function.__name__
    space = metafunc.module.SPACES[name](caps, features, kv)
    choice = metafunc.config.stash[_SWEEP]
    cases = space.cases(choice.sweep, choice.seed)
    choice.taken[f"{metafunc.module.__name__.rsplit('.', 1)[-1]}::{name}"] = (len(cases),
                                                                              space.size)
    metafunc.parametrize("sweep_case", cases, ids=[case_id(c) for c in cases])


def _parametrize_sweep(metafunc: pytest.Metafunc) -> None:
    """The declared-limits dimensions (sweep.py): every declared block size, candidate head
    sizes and GQA groups (undeclared ones are skipped as NOT DECLARED at setup)."""
    from pagedllm.testing import sweep

    cls = _backend_class(metafunc.config)
    caps = cls.capabilities if cls is not None else None
    if "conformance_sweep_block_size" in metafunc.fixturenames:
        sizes = sorted(caps.block_sizes) if caps is not None else [16]
        metafunc.parametrize("conformance_sweep_block_size", sizes, ids=[f"bs{s}" for s in sizes])
    if "conformance_head_size" in metafunc.fixturenames:
        sizes = sweep.head_sizes(caps)
        metafunc.parametrize("conformance_head_size", sizes, ids=[f"hs{s}" for s in sizes])
    if "conformance_gqa_group" in metafunc.fixturenames:
        groups = sweep.gqa_groups(caps)
        metafunc.parametrize("conformance_gqa_group", groups, ids=[f"g{g}" for g in groups])


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    suite = [item for item in items if _in_suite(item)]
    if not suite:
        return
    _check_backend(config)
    cov = config.stash[_COVERAGE]
    choice = config.stash[_SWEEP]
    if choice.taken:
        cov.header += f"; {choice.describe()}"
        cov.info["sweep"] = {"mode": choice.sweep, "seed": choice.seed,
                             "checks": {k: {"cases": n, "space": t}
                                        for k, (n, t) in choice.taken.items()}}
    _sample(config, suite)
    for item in suite:
        cov.area_of[item.nodeid] = getattr(item.module, "AREA", item.module.__name__)
        cov.needs_of[item.nodeid] = _needs(item)
        cov.label_of[item.nodeid] = f"{item.module.__name__.rsplit('.', 1)[-1]}::{item.name}"
        cov.dims_of[item.nodeid] = _dims(item, cov.area_of[item.nodeid], cov.needs_of[item.nodeid])


def _sample(config: pytest.Config, suite: list[pytest.Item]) -> None:
    """--conformance-sample: which declared cases this run leaves out (sample.py)."""
    from pagedllm.testing.sample import engine_skip, sample_limit, sampled_out

    try:
        limit = sample_limit(config.getoption("pagedllm_sample", None))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.stash[_SAMPLED_OUT] = set()
    if limit is None or config.getoption("pagedllm_full", False):
        return
    cls = _backend_class(config)
    assert cls is not None

    def declared(item: pytest.Item) -> bool:
        return (engine_skip(cls, item.module) is None
                and all(has_capability(cls.capabilities, n) for n in _needs(item)))

    config.stash[_SAMPLED_OUT] = sampled_out(suite, limit, declared)
    cov = config.stash[_COVERAGE]
    cov.header += (f"; sampled: at most {limit} case(s) per check, every declared value once "
                   f"({len(config.stash[_SAMPLED_OUT])} cases sampled out)")


def _dims(item: pytest.Item, area: str, needs: list[str]) -> CheckDims:
    """The check's place in the PASS/FAIL matrix: capability x dtype x block size x head size."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    case = params.get("sweep_case") or {}
    named = getattr(item.module, "CAPABILITY_OF", {}).get(getattr(item, "originalname", ""))
    if case and named:  # a swept check keeps one row per dtype, whatever its case needs
        return CheckDims(capability=named, dtype=case.get("dtype"),
                         block_size=case.get("block_size"), head_size=case.get("head_size"),
                         gqa_group=case.get("group"))
    own = [n for n in needs if not n.startswith(("dtype:", "head_size:", "gqa_group:"))]
    block = params.get("conformance_block_size", params.get("conformance_sweep_block_size"))
    head = params.get("conformance_head_size", params.get("head_size"))
    return CheckDims(capability=capability_label(own[0]) if own else named or area,
                     dtype=params.get("conformance_dtype"), block_size=block, head_size=head,
                     gqa_group=params.get("conformance_gqa_group"))


def _backend_facts(cls: type[Backend]) -> dict[str, Any]:
    """What the JSON report says about the run besides its checks."""
    import dataclasses
    import platform

    import torch

    import pagedllm
    from pagedllm.contract.version import PLUGIN_API_VERSION
    from pagedllm.testing.report import git_commit

    return {"commit": git_commit(os.path.dirname(os.path.dirname(pagedllm.__file__))),
            "pagedllm_version": pagedllm.__version__, "plugin_api_version": PLUGIN_API_VERSION,
            "backend_plugin_api_version": getattr(cls, "plugin_api_version", None),
            "torch_version": torch.__version__, "python": platform.python_version(),
            "torch_device": cls.torch_device,
            "attention_backend": envs.PAGEDLLM_ATTENTION_BACKEND or "default",
            "capabilities": {k: list(v) if isinstance(v, tuple) else v
                             for k, v in dataclasses.asdict(cls.capabilities).items()}}


def _needs(item: pytest.Item) -> list[str]:
    needs = [n for m in item.iter_markers("capability") for n in m.args]
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "conformance_dtype" in params:
        needs.append(f"dtype:{params['conformance_dtype']}")
    for key in ("conformance_head_size", "head_size"):
        if key in params:
            needs.append(f"head_size:{params[key]}")
    if "conformance_gqa_group" in params:
        needs.append(f"gqa_group:{params['conformance_gqa_group']}")
    case = params.get("sweep_case") or {}
    if "dtype" in case:
        needs.append(f"dtype:{case['dtype']}")
    if "head_size" in case:
        needs.append(f"head_size:{case['head_size']}")
    if case.get("group", 1) > 1:
        needs.append(f"gqa_group:{case['group']}")
    if case.get("kv_cache", "auto") != "auto":
        needs.append(f"kv_cache:{case['kv_cache']}")
    if case.get("feature", "none") != "none":
        needs.append(f"feature:{case['feature']}")
    return needs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _in_suite(item):
        return
    cls = _backend_class(item.config)
    assert cls is not None  # _check_backend stopped the run otherwise
    cov = item.config.stash[_COVERAGE]
    for need in cov.needs_of.get(item.nodeid, []):
        if not has_capability(cls.capabilities, need):
            cov.missing[item.nodeid] = need
            pytest.skip(f"backend {device_name(item.config)!r} {NOT_DECLARED}"
                        f"{capability_label(need)}")
        choice = envs.PAGEDLLM_ATTENTION_BACKEND
        if choice and not chosen_attention_supports(cls, need):
            cov.missing[item.nodeid] = need
            pytest.skip(f"backend {device_name(item.config)!r} with attention {choice!r} "
                        f"{NOT_DECLARED}{capability_label(need)}")
    from pagedllm.testing.sample import SAMPLED_OUT, engine_skip

    reason = engine_skip(cls, item.module)
    if reason:
        pytest.skip(reason)
    if item.nodeid in item.config.stash.get(_SAMPLED_OUT, set()):
        pytest.skip(f"{SAMPLED_OUT} (--conformance-sample): another case of this check runs "
                    "each of its declared parameter values")


def chosen_attention_supports(cls: type[Backend], need: str) -> bool:
    """With an explicit --attention-backend, a backend-wide feature or KV-cache dtype counts
    only where that implementation takes it: its ``supported_features``, and an
    ``attention_cls`` that does not refuse the KV-cache dtype."""
    from pagedllm.testing.sweep import FEATURE, KV_CACHE_DTYPE

    if not need.startswith((FEATURE, KV_CACHE_DTYPE)):
        return True
    from pagedllm.testing.harness import make_config

    backend = cls()
    caps = cls.capabilities
    kv = need[len(KV_CACHE_DTYPE):] if need.startswith(KV_CACHE_DTYPE) else None
    try:
        config = make_config(backend, dtype=caps.dtypes[0], block_size=caps.preferred_block_size,
                             kv_cache_dtype=kv)
        impl = backend.attention_cls(config)
    except ValueError:  # the chosen implementation refuses it, naming why
        return False
    if need.startswith(FEATURE):
        return need[len(FEATURE):] in getattr(impl, "supported_features", ())
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Collects the figures (max error, NMSE) the check records through metrics.assert_close."""
    if not _in_suite(item):
        yield
        return
    from pagedllm.testing.coverage import SHAPES
    from pagedllm.testing.metrics import SINK

    SINK.open()
    SHAPES.open()
    try:
        yield
    finally:
        cov = item.config.stash[_COVERAGE]
        cov.figures[item.nodeid] = [f.as_dict() for f in SINK.close()]
        cov.shapes[item.nodeid] = SHAPES.close()


class _Recorder:
    """Feeds every test report of the session into its Coverage."""

    def __init__(self, coverage: Coverage) -> None:
        self.coverage = coverage

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        message = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        elif report.outcome == "failed":
            message = getattr(report, "longreprtext", "")[-2000:]
        self.coverage.record(report.nodeid, report.when, report.outcome, message)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash[_COVERAGE].lines() if _COVERAGE in config.stash else []
    if not lines:
        return
    terminalreporter.write_sep("=", f"pagedllm conformance: {config.stash[_COVERAGE].backend}")
    for line in lines:
        terminalreporter.write_line(line)
    path = config.getoption("pagedllm_report", None)
    if path:
        config.stash[_COVERAGE].write_json(path)
        terminalreporter.write_line(f"conformance report written to {path}")


# --- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def conformance_device_name(pytestconfig: pytest.Config) -> str:
    """The --device the suite checks."""
    return device_name(pytestconfig)


@pytest.fixture(scope="session")
def conformance_backend(conformance_device_name: str) -> Backend:
    """An instance of the backend under test, resolved by name like ``--device NAME``."""
    from pagedllm.contract.registry import resolve_backend

    return resolve_backend(conformance_device_name)


@pytest.fixture(scope="session")
def conformance_caps(conformance_backend: Backend) -> Capabilities:
    return conformance_backend.capabilities


@pytest.fixture(scope="session")
def conformance_device(conformance_backend: Backend) -> torch.device:
    import torch

    return torch.device(conformance_backend.torch_device)


@pytest.fixture(scope="session")
def conformance_sweep_mode(pytestconfig: pytest.Config) -> str:
    """The run's sweep: "pairs", "values" (sampled runs of slow backends) or "full"."""
    return pytestconfig.stash[_SWEEP].sweep


@pytest.fixture
def conformance_rng() -> torch.Generator:
    """A CPU generator with a fixed seed: fresh random inputs, reproducible failures."""
    import torch

    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def conformance_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random-weight Llama checkpoint (GQA, head size 64) built once per run."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pagedllm.testing.e2e import make_conformance_checkpoint

    return make_conformance_checkpoint(str(tmp_path_factory.mktemp("conformance-llama")))


@pytest.fixture(scope="session")
def conformance_hf_reference(conformance_checkpoint: str,
                             conformance_caps: Capabilities) -> tuple[list, list]:
    """(prompts, Hugging Face greedy outputs) for the backend's preferred block size."""
    from pagedllm.testing.e2e import hf_greedy, prompts

    ps = prompts(conformance_caps.preferred_block_size)
    return ps, hf_greedy(conformance_checkpoint, ps)
