"""benchmarks/guided.py: the --preset checkpoint (a preset's shape with the demo tokenizer) loads
and spells JSON, and one pagedllm worker run gives guided and unconstrained runs the same token
counts (the schema cannot finish early) with its step profile filled in."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import guided  # noqa: E402


def test_preset_checkpoint_and_profiled_worker(tmp_path: Path) -> None:
    model = guided.write_preset("tiny", "float32", tmp_path)
    config = json.loads((model / "config.json").read_text())
    demo = json.loads((guided.DEMO / "config.json").read_text())
    assert config["vocab_size"] == demo["vocab_size"] and config["hidden_size"] == 128
    spec = {"backend": "pagedllm", "model": str(model), "dtype": "float32", "device": "cpu",
            "num_prompts": 3, "output_len": 6, "repeats": 1, "profile": True,
            "kv_cache_space_gib": 0.05}
    r = guided.worker(spec)
    assert ([x["tokens"] for x in r["plain"]] == [x["tokens"] for x in r["guided"]]
            == [x["tokens"] for x in r["guided_overlap"]] == [18])  # cpu: serial default
    prof = r["profile_ms_per_step"]
    assert prof["step"] > 0 and prof["advance"] > 0 and prof["apply"] > 0
    assert prof["job"] > 0, "no row was filled by xgrammar"
    summary = guided.summarize(r)
    assert 0 < summary["guided_over_plain"] and 0 < summary["overlap_fill_guided_over_plain"]
    assert summary["profile_ms_per_step"] == prof
