"""PAGEDLLM_CPU_OMP_THREADS_BIND (pagedllm/backends/cpu/threads.py, csrc/cpu/threads_cpu.cpp):
parsing and errors; after a cpu worker starts with auto, every thread that runs torch's parallel
work is bound to one CPU of its own (read back from /proc/self/task/*/status); greedy generation
equals the unbound run's token for token (float32) with close logprobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.backends.cpu.threads import BIND_ENV, BindSpec, cpus_for_rank, parse_bind

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("raw, spec", [
    ("auto", BindSpec("auto")),
    (" AUTO ", BindSpec("auto")),
    ("nobind", BindSpec("nobind")),
    ("all", BindSpec("nobind")),  # vLLM 0.7's spelling
    ("0-1", BindSpec("list", ((0, 1),))),
    ("3,0,5-6", BindSpec("list", ((3, 0, 5, 6),))),
    ("0-1|2-3", BindSpec("list", ((0, 1), (2, 3)))),
])
def test_parse_forms(raw: str, spec: BindSpec) -> None:
    assert parse_bind(raw) == spec


def test_unset_is_the_default() -> None:
    from pagedllm.backends.cpu.threads import DEFAULT_BIND

    assert parse_bind(None) == parse_bind("") == parse_bind(DEFAULT_BIND)


@pytest.mark.parametrize("raw", ["any", "1-0", "0,0", "0-1,1", "a-b", "0,", "-1", "0|", "0;1"])
def test_bad_values_name_the_variable_and_the_forms(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bind(raw)
    message = str(info.value)
    assert BIND_ENV in message and repr(raw.strip()) in message
    assert "'auto'" in message and "'nobind'" in message and "0-3" in message


def test_per_rank_lists() -> None:
    spec = parse_bind("0-1|2-3")
    assert cpus_for_rank(spec, 1, 2) == (2, 3)
    assert cpus_for_rank(parse_bind("4,5"), 1, 2) == (4, 5)  # one list serves every rank
    with pytest.raises(ValueError, match="2 '\\|'-separated CPU lists but the engine has 3 ranks"):
        cpus_for_rank(spec, 0, 3)
    assert cpus_for_rank(parse_bind("nobind"), 0, 1) is None


def test_auto_splits_the_allowed_cpus_between_ranks() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    ranks = len(cpus)
    shares = [cpus_for_rank(BindSpec("auto"), r, ranks) for r in range(ranks)]
    assert [c for share in shares for c in share] == cpus  # one CPU each, disjoint, in order
    assert cpus_for_rank(BindSpec("auto"), 0, 1) == tuple(cpus)


# Runs in a process of its own (binding is per process and would pin pytest's own threads):
# generate, then find the threads that run torch's parallel work by their CPU time.
_CHILD = textwrap.dedent("""
    import json, logging, os, sys, time
    import torch
    logging.basicConfig(level=logging.INFO)
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, kv_cache_space_gib=0.05)
    prompts = [{"prompt_token_ids": [5 + (7 * i + j) % 250 for j in range(12 + i)]}
               for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0,
                                                ignore_eos=True), use_tqdm=False)

    def ticks() -> dict[str, int]:
        found = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = open(f"/proc/self/task/{tid}/stat").read()
            except OSError:
                continue
            found[tid] = int(stat.rsplit(")", 1)[1].split()[11])  # utime
        return found

    before = ticks()
    x = torch.ones(1 << 22)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # at::parallel_for regions of every intra-op thread
        x.exp_().mul_(0.0)
    after = ticks()
    busy = {}
    for tid, t in after.items():
        if t - before.get(tid, 0) >= 2:
            for line in open(f"/proc/self/task/{tid}/status"):
                if line.startswith("Cpus_allowed_list:"):
                    busy[tid] = line.split(":", 1)[1].strip()
    json.dump(dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                   logprobs=[o.outputs[0].cumulative_logprob for o in outs],
                   busy=busy, threads=torch.get_num_threads(),
                   allowed=sorted(os.sched_getaffinity(0))), open(sys.argv[2], "w"))
""")


def _run_child(model: str, bind: str, tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / f"{bind}.json"
    env = dict(os.environ, **{BIND_ENV: bind})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, model, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_auto_binds_every_pool_thread_and_generation_is_unchanged(
        checkpoint_factory, cpu_kernels, tmp_path: Path) -> None:
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:
        pytest.skip(f"sched_setaffinity is not allowed here: {exc}")
    model = checkpoint_factory("llama")
    bound, log = _run_child(model, "auto", tmp_path)
    free, _ = _run_child(model, "nobind", tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    assert f"{BIND_ENV}=auto: {len(cpus)} OpenMP threads bound one per CPU" in log
    assert bound["threads"] == len(cpus)
    # every thread that ran parallel work is bound to one CPU; no two share one; all are used
    masks = [_cpu_list(m) for m in bound["busy"].values()]
    assert len(masks) == len(cpus), bound["busy"]
    assert all(len(m) == 1 for m in masks), bound["busy"]
    assert sorted(m[0] for m in masks) == cpus
    if len(cpus) > 1:  # unbound, the same threads may run anywhere (the check above can fail)
        assert any(len(_cpu_list(m)) > 1 for m in free["busy"].values()), free["busy"]
    assert bound["tokens"] == free["tokens"]
    assert bound["logprobs"] == pytest.approx(free["logprobs"], abs=1e-4)


def test_explicit_list_binds_and_sets_the_thread_count(cpu_kernels, tmp_path: Path) -> None:
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
    except (AttributeError, OSError) as exc:
        pytest.skip(f"sched_setaffinity is not allowed here: {exc}")
    cpu = max(os.sched_getaffinity(0))
    code = ("import json, os, sys, torch\n"
            "from pagedllm.backends.cpu.threads import apply_thread_binding\n"
            f"print(json.dumps([list(apply_thread_binding(0, 1, '{cpu}')), "
            "torch.get_num_threads(), sorted(os.sched_getaffinity(0))]))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[cpu], 1, [cpu]]


def test_a_cpu_outside_the_mask_is_a_clear_error(cpu_kernels, tmp_path: Path) -> None:
    code = ("from pagedllm.backends.cpu.threads import apply_thread_binding\n"
            "apply_thread_binding(0, 1, '1000')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert f"{BIND_ENV}='1000': cannot bind the OpenMP threads to CPUs [1000]" in proc.stderr
