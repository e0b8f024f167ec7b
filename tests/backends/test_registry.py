from __future__ import annotations

import pytest

from pagedllm.backends.registry import discover, resolve_backend


def test_cpu_is_always_listed_and_available() -> None:
    infos = discover()
    assert infos["cpu"].availability() == (True, "always available")
    assert infos["cpu"].source == "built-in"


def test_auto_falls_back_to_an_available_backend() -> None:
    backend = resolve_backend("auto")
    ok, _ = backend.availability()
    assert ok


def test_unknown_device_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"device='quantum' is not a known backend; known: auto, .*cpu"):
        resolve_backend("quantum")


def test_unavailable_device_gives_reason_and_alternatives() -> None:
    infos = discover()
    unavailable = [n for n, i in infos.items() if not i.availability()[0]]
    if not unavailable:
        pytest.skip("every known backend is available here")
    name = unavailable[0]
    reason = infos[name].availability()[1]
    with pytest.raises(RuntimeError) as err:
        resolve_backend(name)
    assert reason in str(err.value) and "Available here:" in str(err.value)
    assert "cpu" in str(err.value)
