"""Where the batch-1 decode step loses time between its GEMVs: per-block timestamps of every GEMV
launch of a few engine steps, from a kernel build with -DPL_GEMV_TRACE.

    PAGEDLLM_KERNEL_FLAGS=-DPL_GEMV_TRACE python benchmarks/gemv_trace.py \\
        --model .carry/llama3-8b-shape --load-format dummy

For each linear (qkv, o_proj, gate_up, down, lm_head), over the layers of the traced steps, the
median in microseconds of: `chain`, from the previous GEMV's last block exit to this GEMV's first
block passing its dependency wait (the kernels in between and the launch hand-offs); `run`, from
that first wait to this GEMV's last exit; `ideal`, its weight bytes at --bandwidth; `skew`, last
minus first block exit; `late`, last minus first block passing the wait; `resident`, from the
previous GEMV's last exit to this GEMV's last block entering (its blocks take an SM only when the
previous GEMV's leave). The step's first GEMV is listed apart: its chain is the step boundary
(sampling, the next step's inputs, the graph launch).
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cuda import ops


def linear_names(model: torch.nn.Module) -> dict[int, str]:
    names = {}
    for name, param in model.named_parameters():
        if param.dim() == 2:
            kind = name.split(".")[-2]
            names[param.data_ptr()] = {"qkv_proj": "qkv", "gate_up_proj": "gate_up",
                                       "down_proj": "down"}.get(kind, kind)
    return names


def launches(records: torch.Tensor) -> list[dict]:
    """Group block records into launches: per weight, consecutive runs of `blocks` records."""
    by_weight = defaultdict(list)
    for rec in records.tolist():
        by_weight[rec[0]].append(rec)
    out = []
    for weight, recs in by_weight.items():
        recs.sort(key=lambda r: r[3])
        blocks = len({r[1] & 0xffffffff for r in recs})
        for i in range(0, len(recs) - blocks + 1, blocks):
            group = recs[i:i + blocks]
            out.append({"weight": weight,
                        "entry": (min(r[2] for r in group), max(r[2] for r in group)),
                        "wait": (min(r[3] for r in group), max(r[3] for r in group)),
                        "exit": (min(r[4] for r in group), max(r[4] for r in group))})
    out.sort(key=lambda launch: launch["wait"][0])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bandwidth", type=float, default=4.6, help="TB/s for the ideal column")
    args = p.parse_args()
    kernels = ops.load_kernels()
    if not hasattr(kernels, "gemv_trace"):
        raise SystemExit("build the kernels with PAGEDLLM_KERNEL_FLAGS=-DPL_GEMV_TRACE")
    llm = LLM(args.model, device="cuda", dtype="bfloat16", load_format=args.load_format,
              max_num_seqs=1)
    model = llm.llm_engine.executor.worker.model
    names = linear_names(model)
    sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    prompt = {"prompt_token_ids": list(range(1, 129))}
    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    llm.generate(prompt, greedy(16), use_tqdm=False)
    kernels.gemv_trace()  # drop the warm-up's records
    llm.generate(prompt, greedy(args.steps + 8), use_tqdm=False)
    torch.cuda.synchronize()
    all_launches = [x for x in launches(kernels.gemv_trace()) if x["weight"] in names]
    # the decode steps: from the 2nd lm_head on (the prefill's GEMVs are not one-token GEMVs)
    heads = [i for i, x in enumerate(all_launches) if names[x["weight"]] == "lm_head"]
    last = min(len(heads) - 1, args.steps + 1)
    n_steps = last - 1
    span = all_launches[heads[1]:heads[last] + 1]  # the first launch only ends the step before
    stats = defaultdict(lambda: defaultdict(list))
    first_qkv = names[span[1]["weight"]]  # the step's first GEMV: its chain is the step boundary
    for prev, cur in zip(span, span[1:]):
        kind = names[cur["weight"]]
        if names[prev["weight"]] == "lm_head":
            kind = f"{first_qkv} (step start)"
        s = stats[kind]
        s["chain"].append(cur["wait"][0] - prev["exit"][1])
        s["run"].append(cur["exit"][1] - cur["wait"][0])
        s["skew"].append(cur["exit"][1] - cur["exit"][0])
        s["late"].append(cur["wait"][1] - cur["wait"][0])
        s["resident"].append(cur["entry"][1] - prev["exit"][1])
        s["ideal"].append(sizes[cur["weight"]] / (args.bandwidth * 1e12) * 1e9)
    steps = (span[-1]["exit"][1] - span[0]["exit"][1]) / 1e3 / n_steps
    print(f"{len(span) - 1} GEMV launches over {n_steps} steps; {steps:.0f} us per step (medians "
          f"over the launches; per step: the means)")
    cols = ["chain", "run", "ideal", "skew", "late", "resident"]
    print("| linear | n | " + " | ".join(f"{c} us" for c in cols) +
          " | per step us (chain + run) |")
    print("|---|---:|" + "---:|" * (len(cols) + 1))
    total = 0.0
    for kind, s in stats.items():
        median = {c: statistics.median(s[c]) / 1e3 for c in cols}
        per_step = (sum(s["chain"]) + sum(s["run"])) / 1e3 / n_steps
        total += per_step
        print(f"| {kind} | {len(s['chain'])} | " + " | ".join(f"{median[c]:.2f}" for c in cols) +
              f" | {per_step:.0f} |")
    print(f"sum of chain + run per step: {total:.0f} us")


if __name__ == "__main__":
    main()
