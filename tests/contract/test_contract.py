"""The contract package's own promises: what built-in backends name resolves, the op table's
spec and the reference table agree, the quantization names agree with the loaders, and a
plugin's stated version is judged by the compatibility rule."""
from __future__ import annotations

import pytest

from pagedllm.contract.ops import OP_NAMES, OpTable, check_op_name
from pagedllm.contract.registry import BUILTIN_BACKENDS, is_backend_class, load_class
from pagedllm.contract.version import PLUGIN_API_VERSION, api_incompatibility, parse_version


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKENDS))
def test_builtin_backends_name_a_worker_that_resolves(name: str) -> None:
    """Backend.worker_class strings (the contract imports no worker) load a Worker subclass."""
    from pagedllm.worker.worker import Worker

    backend = load_class(BUILTIN_BACKENDS[name])
    assert is_backend_class(backend)
    assert issubclass(backend().worker_cls(), Worker)


def test_load_class_names_what_is_wrong() -> None:
    assert load_class("pagedllm.worker.worker:Worker").__name__ == "Worker"
    with pytest.raises(ValueError, match="'pagedllm.worker.worker.Worker' is not a class or"):
        load_class("pagedllm.worker.worker.Worker")


def test_reference_table_implements_the_spec() -> None:
    from pagedllm.reference.ops import Ops

    table = Ops()
    assert set(OP_NAMES) <= set(vars(OpTable)) and "register" not in OP_NAMES
    assert all(callable(getattr(table, name)) for name in OP_NAMES)
    with pytest.raises(ValueError, match="unknown op 'rmsnorm'; known ops: rms_norm"):
        table.register("rmsnorm", lambda *a: None)
    check_op_name("rotary")


def test_quantization_names_agree_with_the_loaders() -> None:
    from pagedllm.contract.quantization import QUANTIZATION_METHOD_NAMES
    from pagedllm.models.layers.quantization import QUANTIZATION_METHODS

    assert tuple(QUANTIZATION_METHODS) == QUANTIZATION_METHOD_NAMES


def test_a_plugin_for_the_previous_minor_loads_and_another_major_does_not() -> None:
    major, minor = parse_version(PLUGIN_API_VERSION)
    assert api_incompatibility(f"{major}.{max(minor - 1, 0)}") is None
    assert api_incompatibility(f"{major}.0") is None
    assert "newer than" in api_incompatibility(f"{major}.{minor + 1}")
    assert "major versions must match" in api_incompatibility(f"{major + 1}.0")
    assert "not 'major.minor'" in api_incompatibility("two")
