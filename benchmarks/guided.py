"""Guided decoding cost: offline throughput with a JSON schema on every request vs the same
workload unconstrained, and time to first token with a never-seen schema (issue 33).

    python benchmarks/guided.py [--model PATH | --preset bench99m --dtype bfloat16] \\
        --num-prompts 64 --output-len 64 --backend pagedllm,vllm \\
        [--vllm-python /work/venvs/vllm/bin/python] [--repeats 3]

Each engine runs in its own subprocess (this file with --worker). The schema (an object holding
an array of at least 64 bounded strings) cannot complete within --output-len tokens, so guided
and unconstrained requests produce the same number of tokens (sampled, temperature 1, seeded).
TTFT is the wall time of a one-token request on the idle, warmed-up engine; "cold" gives the
request a schema the engine has not seen (a fresh grammar to compile), "plain" none.
``--preset`` runs a bigger model than the demo: that preset's shape (benchmarks/make_model.py,
e.g. bench99m: 8 layers of hidden 1024) with random weights and the demo model's byte-level BPE
tokenizer and 8,192-token vocabulary (the presets' own WordLevel tokens spell no JSON), written to
a temporary folder that both engines load. pagedllm also runs the guided workload with its
matcher job run the other way, round robin with the others (``serial_fill_guided_over_plain``:
on the engine thread before the forward, where the default overlaps it; ``overlap_fill_...``:
on a helper thread during the forward, where the default, as on cpu, does not); ``--profile``
adds one guided run with its guided-decoding work timed per step.
Target: guided throughput >= 85% of unconstrained.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger("guided")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "pagedllm" / "models" / "demo_model"


def workload_schema(tag: str = "items") -> dict[str, Any]:
    return {"type": "object", "properties": {tag: {
        "type": "array", "minItems": 64, "maxItems": 64,
        "items": {"type": "string", "minLength": 3, "maxLength": 12}}},
        "required": [tag], "additionalProperties": False}


# --- the worker (one engine in this process) ------------------------------------------------
def _guided_params(schema: dict[str, Any], api: str) -> dict[str, Any]:
    """SamplingParams keywords constraining to ``schema`` in this engine's API."""
    if api == "pagedllm":
        from pagedllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(json=schema)}
    try:  # vLLM >= 0.10: structured_outputs
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(json=schema)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams as VllmGuided

        return {"guided_decoding": VllmGuided(json=schema)}


def _profile_guided(llm: Any) -> dict[str, float]:
    """Wraps pagedllm's guided-decoding steps with timers; returns the dict of seconds they add
    to (engine thread: ``mask_build`` bookkeeping and the fill's start, ``mask_wait`` the
    sampler's wait for the mask after the forward, ``apply`` the op, ``advance`` recording the
    sampled tokens; helper thread: ``job`` xgrammar accepting them and filling the rows) plus
    ``steps``."""
    from pagedllm.engine.guided import manager

    totals: dict[str, float] = {"mask_build": 0.0, "mask_wait": 0.0, "job": 0.0,
                                "apply": 0.0, "advance": 0.0, "steps": 0.0}

    def timed(fn: Any, key: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[key] += time.perf_counter() - t0
        return call

    guided = llm.llm_engine.guided
    guided.bitmask = timed(guided.bitmask, "mask_build")
    guided.advance = timed(guided.advance, "advance")
    guided._job = timed(guided._job, "job")
    manager.PendingBitmask.result = timed(manager.PendingBitmask.result, "mask_wait")
    sampler = llm.llm_engine.executor.worker.runner.sampler
    sampler.apply_token_bitmask = timed(sampler.apply_token_bitmask, "apply")
    step = llm.llm_engine.step

    def counted() -> Any:
        totals["steps"] += 1
        return step()
    llm.llm_engine.step = counted
    return totals


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    api = spec["backend"]
    if api == "pagedllm":
        from pagedllm import LLM, SamplingParams

        kw: dict[str, Any] = {"device": spec["device"],
                              "kv_cache_space_gib": spec.get("kv_cache_space_gib", 2)}
    else:
        from vllm import LLM, SamplingParams

        kw = {}
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=256, **kw)
    load_s = time.perf_counter() - start
    prompts = [f"Item {i}: describe it as JSON." for i in range(spec["num_prompts"])]

    def params(i: int, guided: dict[str, Any] | None, max_tokens: int) -> Any:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, **(guided or {}))

    def run(guided: dict[str, Any] | None) -> tuple[float, int]:
        ps = [params(i, guided, spec["output_len"]) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    guided = _guided_params(workload_schema(), api)
    run(None), run(guided)  # warm-up (and the workload schema compiled once, as a server would)
    result: dict[str, Any] = {"backend": api, "load_s": load_s, "plain": [], "guided": []}
    modes: list[tuple[str, Any]] = [("plain", None), ("guided", guided)]
    if api == "pagedllm":  # A/B: the matcher job run the engine's other way
        overlap = llm.llm_engine.guided.overlap  # the default (or $PAGEDLLM_GUIDED_OVERLAP)
        other = "guided_serial" if overlap else "guided_overlap"
        modes.append((other, guided))
        result[other] = []
    for _ in range(spec["repeats"]):  # round robin, so drift hits every mode alike
        for mode, g in modes:
            if api == "pagedllm":
                llm.llm_engine.guided.overlap = overlap != (mode == other)
            elapsed, tokens = run(g)
            result[mode].append({"elapsed_s": elapsed, "tokens": tokens,
                                 "tok_s": tokens / elapsed})
    if api == "pagedllm":
        llm.llm_engine.guided.overlap = overlap
    for mode in ("ttft_plain", "ttft_cold"):
        times = []
        for _ in range(spec["repeats"]):
            g = (_guided_params(workload_schema("k" + uuid.uuid4().hex[:8]), api)
                 if mode == "ttft_cold" else None)
            t0 = time.perf_counter()
            llm.generate([prompts[0]], [params(0, g, 1)], use_tqdm=False)
            times.append(time.perf_counter() - t0)
        result[mode] = times
    if spec.get("profile") and api == "pagedllm":  # one more guided run, its steps timed
        totals = _profile_guided(llm)
        elapsed, _ = run(guided)
        steps = max(1.0, totals.pop("steps"))
        result["profile_ms_per_step"] = {"step": round(1e3 * elapsed / steps, 3), **{
            k: round(1e3 * v / steps, 3) for k, v in totals.items()}}
    return result


# --- the driver -----------------------------------------------------------------------------
def write_preset(preset: str, dtype: str, out_dir: Path) -> Path:
    """``preset``'s model shape with the demo model's tokenizer, vocabulary size and special
    ids, seeded random weights in ``dtype``, to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from make_model import make_config

    demo = json.loads((DEMO / "config.json").read_text())
    config = make_config(preset, dtype)
    config.vocab_size = demo["vocab_size"]
    config.bos_token_id = config.eos_token_id = demo["eos_token_id"]
    config.pad_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=demo["bos_token_id"],
                                               eos_token_id=demo["eos_token_id"])
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, out_dir / name)
    logger.info("%s shape, demo tokenizer, %s: %.1fM parameters in %s", preset, dtype,
                sum(p.numel() for p in model.parameters()) / 1e6, out_dir)
    return out_dir


def run_engine(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    python = args.vllm_python if backend == "vllm" else sys.executable
    spec = {"backend": backend, "model": args.model, "dtype": args.dtype, "device": args.device,
            "num_prompts": args.num_prompts, "output_len": args.output_len,
            "repeats": args.repeats, "profile": args.profile}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", TOKENIZERS_PARALLELISM="false")
        if backend == "vllm":  # hides the vLLM venv's broken torchvision builds (_vllm_site/)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "benchmarks" /
                                                                  "_vllm_site"),
                                                              env.get("PYTHONPATH")]))
        proc = subprocess.run([python, __file__, "--worker", str(spec_path), str(out_path)],
                              env=env, cwd=REPO_ROOT)
        if proc.returncode != 0 or not out_path.exists():
            return {"backend": backend, "error": f"exit code {proc.returncode}"}
        return json.loads(out_path.read_text())


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    if "error" in r:
        return r
    plain = statistics.median(x["tok_s"] for x in r["plain"])
    guided = statistics.median(x["tok_s"] for x in r["guided"])
    out = {"backend": r["backend"], "plain_tok_s": round(plain, 1),
           "guided_tok_s": round(guided, 1), "guided_over_plain": round(guided / plain, 3),
           "ttft_plain_ms": round(1e3 * statistics.median(r["ttft_plain"]), 1),
           "ttft_cold_schema_ms": round(1e3 * statistics.median(r["ttft_cold"]), 1)}
    for mode in ("guided_serial", "guided_overlap"):  # the default's alternative
        if r.get(mode):
            alt = statistics.median(x["tok_s"] for x in r[mode])
            out[mode.split("_")[1] + "_fill_guided_over_plain"] = round(alt / plain, 3)
    if "profile_ms_per_step" in r:
        out["profile_ms_per_step"] = r["profile_ms_per_step"]
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(worker(spec)))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="pagedllm",
                   help="comma-separated: pagedllm, vllm (vLLM runs under --vllm-python)")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    p.add_argument("--preset", default=None,
                   help="a benchmarks/make_model.py preset (e.g. bench99m) with the demo "
                        "tokenizer, instead of --model")
    p.add_argument("--profile", action="store_true",
                   help="pagedllm: one more guided run with its guided-decoding work timed "
                        "(ms per engine step)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="pagedllm-guided-") as tmp:
        if args.preset is not None:
            args.model = str(write_preset(args.preset, args.dtype, Path(tmp)))
        for backend in [b.strip() for b in args.backend.split(",") if b.strip()]:
            logger.info("%s", json.dumps(summarize(run_engine(backend, args))))


if __name__ == "__main__":
    main()
