"""The model registry: unknown architectures, attention features refused by a backend that lacks
them (before any weight is loaded), and the `pagedllm models` table."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from pagedllm import LLM
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.models import registry
from pagedllm.models.registry import MODEL_REGISTRY, ModelEntry


def _with_config(src: str, dst: str, **changes: object) -> str:
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_unknown_architecture_lists_supported(llama_path: str, tmp_path) -> None:
    path = _with_config(llama_path, str(tmp_path / "m"), architectures=["NoSuchForCausalLM"])
    with pytest.raises(ValueError, match="NoSuchForCausalLM") as info:
        LLM(path, device="cpu", dtype="float32")
    for arch in MODEL_REGISTRY:
        assert arch in str(info.value)


def test_unknown_feature_in_entry_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention feature"):
        ModelEntry("x:Y", features=("flash",))


def test_backend_lacking_a_needed_feature_refuses_the_model(llama_path: str, tmp_path,
                                                            monkeypatch) -> None:
    """A config that turns on a feature the backend does not declare is refused, the feature
    named; the same config without it (sliding_window null) is accepted."""
    entry = MODEL_REGISTRY["LlamaForCausalLM"]
    monkeypatch.setitem(MODEL_REGISTRY, "LlamaForCausalLM",
                        dataclasses.replace(entry, features=("sliding_window",)))
    monkeypatch.setattr(CpuBackend, "capabilities",
                        dataclasses.replace(CpuBackend.capabilities, attention_features=()))
    windowed = _with_config(llama_path, str(tmp_path / "w"), sliding_window=8)
    loads: list[str] = []
    monkeypatch.setattr("pagedllm.worker.worker.load_model",
                        lambda *a, **k: loads.append("x"))  # must not be reached
    with pytest.raises(ValueError, match="sliding_window.*cpu backend") as info:
        LLM(windowed, device="cpu", dtype="float32")
    assert "LlamaForCausalLM" in str(info.value) and not loads
    assert registry.missing_features("LlamaForCausalLM",
                                     type("C", (), {"sliding_window": None})(), ()) == []
    assert registry.missing_features("LlamaForCausalLM",
                                     type("C", (), {"sliding_window": 8})(),
                                     ("sliding_window",)) == []


def test_models_command_table(capsys, monkeypatch) -> None:
    monkeypatch.setitem(registry.FEATURE_PROBES, "test_feature", lambda c: True)
    monkeypatch.setitem(MODEL_REGISTRY, "NeedsTestFeature",
                        ModelEntry("x:Y", features=("test_feature",)))
    with pytest.raises(SystemExit) as info:
        cli_main(["models"])
    assert info.value.code == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == set(MODEL_REGISTRY)
    assert rows["LlamaForCausalLM"][0] == "-" and "cpu" in rows["LlamaForCausalLM"][1].split(",")
    assert rows["LlamaForCausalLM"][2] == "-"
    assert rows["NeedsTestFeature"][:2] == ["test_feature", "none"]
    assert "cpu" in rows["NeedsTestFeature"][2].split(",")
    monkeypatch.setattr(CpuBackend, "capabilities",
                        dataclasses.replace(CpuBackend.capabilities,
                                            attention_features=("test_feature",)))
    with pytest.raises(SystemExit):
        cli_main(["models"])
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert "cpu" in rows["NeedsTestFeature"][1].split(",")
    assert "cpu" not in rows["NeedsTestFeature"][2].split(",")
