"""The GPU operations between one batch-1 decode step's LM head and the next step's first GEMV:
sampling, the next step's inputs, the graph's first kernels, each with its start (us after the LM
head ended) and duration, from torch.profiler.

    python benchmarks/step_boundary.py --model .carry/llama3-8b-shape --load-format dummy
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, RequestOutputKind, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", load_format=args.load_format,
              max_num_seqs=1)
    engine = llm.llm_engine
    engine.add_request("0", {"prompt_token_ids": list(range(1, 129))},
                       SamplingParams(temperature=args.temperature, max_tokens=60, ignore_eos=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    heads = [i for i, e in enumerate(gpu) if "gemv" in e["name"] and e["dur"] > 150]  # LM head
    if len(heads) < 2:
        raise SystemExit("no two LM-head GEMVs recorded: is the GEMV in use (sm_90+, bf16)?")
    h = heads[1]
    end = gpu[h]["ts"] + gpu[h]["dur"]
    print(f"after the LM head ({gpu[h]['dur']:.1f} us), us since it ended:")
    for e in gpu[h + 1:]:
        if "gemv" in e["name"]:
            print(f"  +{e['ts'] - end:7.1f}  the next step's first GEMV")
            break
        print(f"  +{e['ts'] - end:7.1f}  {e['dur']:6.1f} us  {e['cat']:10s} {e['name'][:80]}")


if __name__ == "__main__":
    main()
