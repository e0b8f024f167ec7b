"""One engine (or the GEMM probe) in its own process: ``python _peers.py SPEC.json RESULT.json``.

Started by throughput.py, possibly under another interpreter (the vLLM venv), so this module
imports only the standard library at top level; each runner imports its engine lazily.

SPEC keys: backend, model, dtype, device, seed, load_format, prompts (list of token-id lists),
output_len, output_lens (optional: one output length per prompt, for workloads.py), warmup_prompts, hf_batch_size, kv_cache_gib, max_num_seqs, engine_kwargs (extra LLM
keyword arguments for pagedllm and vLLM, e.g. enable_chunked_prefill).  RESULT keys: backend,
version, device, load_s, warmup_s, elapsed_s, token_ids (one list per prompt), or error.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import Any, Callable

logger = logging.getLogger("peers")

Spec = dict[str, Any]
Result = dict[str, Any]


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _generate_vllm_api(llm: Any, params_cls: Any, spec: Spec) -> tuple[float, float, list]:
    """Warm up, then time ``llm.generate`` over all prompts with the vLLM offline API."""
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    lens = output_lens(spec)
    params = [params_cls(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    warm_prompts, warm_params = prompts[: spec["warmup_prompts"]], params[: spec["warmup_prompts"]]
    if "warmup" in spec:  # prompts of their own (a prefix cache must not hold the timed ones)
        warm_prompts = [{"prompt_token_ids": ids} for ids in spec["warmup"]]
        warm_params = [params_cls(temperature=0.0, max_tokens=n, ignore_eos=True)
                       for n in spec["warmup_output_lens"]]
    start = time.perf_counter()  # full warm-up: every sequence length of the timed run, met once
    llm.generate(warm_prompts, warm_params, use_tqdm=False)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    return warmup_s, elapsed_s, [list(o.outputs[0].token_ids) for o in outputs]


def output_lens(spec: Spec) -> list[int]:
    """The output length of each prompt: spec["output_lens"], else output_len for all."""
    return spec.get("output_lens") or [spec["output_len"]] * len(spec["prompts"])


def timed_runs(spec: Spec, generate: Callable[[Spec], tuple[float, float, list]]) -> Result:
    """warmup_s, elapsed_s and token_ids of ``generate(spec)``; with spec["workloads"] (a list of
    dicts of name, prompts, output_lens, warmup, warmup_output_lens) one run per workload in
    this process, under result["workloads"][name]."""
    if "workloads" not in spec:
        warmup_s, elapsed_s, token_ids = generate(spec)
        return dict(warmup_s=warmup_s, elapsed_s=elapsed_s, token_ids=token_ids)
    runs: dict[str, Any] = {}
    for workload in spec["workloads"]:
        logger.info("workload %s: %d prompts", workload["name"], len(workload["prompts"]))
        warmup_s, elapsed_s, token_ids = generate(dict(spec, **workload))
        runs[workload["name"]] = dict(warmup_s=warmup_s, elapsed_s=elapsed_s, token_ids=token_ids)
    return dict(workloads=runs)


def thread_placement() -> dict[str, Any]:
    """What this engine process runs on: its CPU affinity and torch's intra-op threads."""
    import os

    import torch

    return dict(cpus=sorted(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                vllm_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                vllm_reserved_cpus=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"))


def run_vllm(spec: Spec) -> Result:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"],
              max_num_seqs=spec.get("max_num_seqs", 256),
              load_format=spec["load_format"], **spec.get("engine_kwargs", {}))
    load_s = time.perf_counter() - start
    runs = timed_runs(spec, lambda sub: _generate_vllm_api(llm, SamplingParams, sub))
    return dict(version=vllm.__version__, device=current_platform.device_type,
                load_s=load_s, threads=thread_placement(), **runs)


def run_pagedllm(spec: Spec) -> Result:
    import pagedllm
    from pagedllm import LLM, SamplingParams

    device = _resolve_device(spec["device"])
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], device=device,
              max_num_seqs=spec.get("max_num_seqs", 256),
              load_format=spec["load_format"], kv_cache_space_gib=spec["kv_cache_gib"] or None,
              seed=spec["seed"], **spec.get("engine_kwargs", {}))
    load_s = time.perf_counter() - start
    runs = timed_runs(spec, lambda sub: _generate_vllm_api(llm, SamplingParams, sub))
    return dict(version=getattr(pagedllm, "__version__", "unknown"), device=device,
                load_s=load_s, threads=thread_placement(), **runs)


def _hf_generate(model: Any, prompts: list[list[int]], lens: list[int], batch: int,
                 pad: int) -> list:
    """Greedy, exactly ``lens[i]`` new tokens for prompt i, on left-padded batches. With
    varying lengths the prompts are batched in order of output length, each batch generating
    its longest (the others' extra tokens cut off), and returned in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: lens[i])  # stable: equal lens keep order
    by_index: dict[int, list[int]] = {}
    for i in range(0, len(prompts), batch):
        rows = order[i : i + batch]
        for row, ids in zip(rows, _hf_batch(model, [prompts[r] for r in rows],
                                            max(lens[r] for r in rows), pad)):
            by_index[row] = ids[: lens[row]]
    return [by_index[i] for i in range(len(prompts))]


def _hf_batch(model: Any, chunk: list[list[int]], n: int, pad: int) -> list[list[int]]:
    """Greedy, exactly ``n`` new tokens for each prompt of one left-padded batch."""
    import torch

    width = max(len(p) for p in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [batch, width]
    mask = torch.zeros_like(ids)
    for row, p in enumerate(chunk):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad)
    return gen[:, width:].tolist()


def run_hf(spec: Spec) -> Result:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    device = _resolve_device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    start = time.perf_counter()
    if spec["load_format"] == "dummy":
        torch.manual_seed(spec["seed"])
        config = AutoConfig.from_pretrained(spec["model"])
        with torch.device(device):  # random weights made where they run (8B on a GPU: seconds)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype)
    model = model.to(device).eval()
    load_s = time.perf_counter() - start
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(sub: Spec) -> tuple[float, float, list]:
        prompts, lens = sub["prompts"], output_lens(sub)
        batch = sub["hf_batch_size"] or len(prompts)
        warm, warm_lens = prompts[: sub["warmup_prompts"]], lens[: sub["warmup_prompts"]]
        if "warmup" in sub:
            warm, warm_lens = sub["warmup"], sub["warmup_output_lens"]
        start = time.perf_counter()
        # full warm-up (all n tokens): no sequence length is met for the first time while timed
        _hf_generate(model, warm, warm_lens, batch, pad)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        token_ids = _hf_generate(model, prompts, lens, batch, pad)
        if device == "cuda":
            torch.cuda.synchronize()
        return warmup_s, time.perf_counter() - start, token_ids

    return dict(version=transformers.__version__, device=device, load_s=load_s,
                threads=thread_placement(), **timed_runs(spec, generate))


def _mm_seconds(n: int, dtype: Any, device: str, repeats: int) -> float:
    """Best wall time of ``repeats`` n x n x n torch.mm calls (after one untimed call)."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run_gemm(spec: Spec) -> Result:
    """Best-of-5 torch.mm rate per dtype in GFLOP/s (2 n^3 FLOPs), n = 4096 or smaller when one
    call would take over 2 s (bf16 mm without AVX-512 BF16 runs at ~0.5 GFLOP/s)."""
    import torch

    device = _resolve_device(spec["device"])
    rates: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name in spec["gemm_dtypes"]:
        dtype, n = getattr(torch, name), 512
        while n < spec.get("gemm_size", 4096) and _mm_seconds(n, dtype, device, 1) < 2.0 / 8:
            n *= 2  # the next size takes ~8x longer
        rates[name] = 2 * n**3 / _mm_seconds(n, dtype, device, 5) / 1e9
        sizes[name] = n
    result = dict(version=torch.__version__, device=device, gemm_size=sizes,
                  gemm_gflops=rates, threads=torch.get_num_threads())
    if device == "cuda":  # the decode kernel check's copy probe (this folder is on sys.path)
        from gpu_kernel_check import copy_bandwidth

        result["copy_gbps"] = copy_bandwidth(repeats=10) / 1e9
    return result


def run_roofline(spec: Spec) -> Result:
    """roofline.py's GEMM peaks (spec["gemm_dtypes"]) and memory bandwidth."""
    import torch
    from roofline import measure  # this folder is on sys.path

    return dict(version=torch.__version__, device="cpu", **measure(spec["gemm_dtypes"]))


RUNNERS: dict[str, Callable[[Spec], Result]] = {
    "hf": run_hf, "vllm": run_vllm, "pagedllm": run_pagedllm, "gemm": run_gemm,
    "roofline": run_roofline,
}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, datefmt="%Y-%m-%d %H:%M:%S",  # pagedllm.logger's
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    backend = spec["backend"]
    try:
        result = RUNNERS[backend](spec)
        code = 0
    except ImportError as e:
        result, code = dict(error=f"{backend} not installed ({e})", skipped=True), 0
    except Exception as e:  # reported to the parent, which carries on with the other engines
        traceback.print_exc()
        result, code = dict(error=f"{type(e).__name__}: {e}"), 1
    result["backend"] = backend
    with open(result_path, "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
