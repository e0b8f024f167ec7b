"""The cpu worker's memory behaviour: glibc keeps what a step frees (heap.py), the lazily mapped
KV cache asks for huge pages (host_memory.py), and one full-size step runs at start-up."""
from __future__ import annotations

import ctypes.util
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.backends.cpu.heap import KEEP_FREED_MEMORY_ENV
from pagedllm.backends.cpu.worker import WARMUP_MAX_TOKENS, CpuWorker
from pagedllm.worker.host_memory import lazy_zeros

# A child process: apply the setting, then count the page faults of a 48 MiB tensor made and
# freed, round after round (over glibc's largest mmap threshold, so by default each is mapped
# and unmapped again). With freed memory kept, glibc's heap grows for the first rounds (a
# 64-byte-aligned request does not fit the exact hole a freed one leaves until holes coalesce),
# then serves every round from pages already mapped: the last rounds count.
_FAULTS_SCRIPT = """
import json, resource, torch
from pagedllm.backends.cpu.heap import keep_freed_memory
applied = keep_freed_memory()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(12 << 20).fill_(1.0)  # 48 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
rounds = [faults() for _ in range(16)]
print(json.dumps({"applied": applied, "faults": sum(rounds[-4:]), "rounds": rounds}))
"""


def _faults_after_reuse(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop(KEEP_FREED_MEMORY_ENV, None)
    if env_value is not None:
        env[KEEP_FREED_MEMORY_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


glibc = pytest.mark.skipif(ctypes.util.find_library("c") is None
                           or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="needs glibc")


@glibc
def test_freed_memory_is_reused_without_page_faults() -> None:
    kept = _faults_after_reuse(None)
    assert kept["applied"] is True
    assert kept["faults"] < 1000, kept  # 4 x 48 MiB in 4 KiB pages would be ~49k faults


@glibc
def test_environment_turns_keeping_freed_memory_off() -> None:
    default = _faults_after_reuse("0")
    assert default["applied"] is False
    assert default["faults"] > 40000, default  # glibc's default: unmapped, faulted again


# A child process: keep freed memory, then free 64 MiB of small tensors that a live one above
# them pins below the heap's top (what the released weights of a loaded model look like), and
# read the resident set before and after release_free_pages.
_TRIM_SCRIPT = """
import json, torch
from pagedllm.backends.cpu.heap import keep_freed_memory, release_free_pages
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
keep_freed_memory()
parts = [torch.ones(1 << 20) for _ in range(16)]  # 16 x 4 MiB, written (resident)
top = torch.ones(1 << 20)
del parts
before = rss_mib()
released = release_free_pages()
print(json.dumps({"released": released, "before": before, "after": rss_mib()}))
"""


@glibc
def test_release_free_pages_hands_freed_heap_back() -> None:
    out = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT], check=True, capture_output=True,
                         text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["released"] is True, got
    assert got["before"] - got["after"] > 48, got  # of the 64 MiB freed below the live top


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or _thp_mode() in (None, "never"),
                    reason="no transparent huge pages on this kernel")
def test_lazy_zeros_asks_for_huge_pages_and_reads_zero() -> None:
    cache = lazy_zeros((4, 1024, 1024), torch.float32)  # 16 MiB
    assert "hg" in _vm_flags(cache.data_ptr())  # madvise(MADV_HUGEPAGE) on the mapping
    assert torch.count_nonzero(cache) == 0
    cache[3, 1023, 1023] = 2.0
    assert cache.sum().item() == 2.0


def test_cpu_worker_warms_up_at_the_capped_budget(llama_path: str, monkeypatch) -> None:
    steps: list[int] = []
    real = CpuWorker.profile_run

    def recording(self, max_tokens=None):
        runner_execute = self.runner.execute

        def execute(batch, caches):
            steps.append(sum(s.num_tokens for s in batch.seqs))
            return runner_execute(batch, caches)

        self.runner.execute = execute
        try:
            return real(self, max_tokens)
        finally:
            del self.runner.execute

    monkeypatch.setattr(CpuWorker, "profile_run", recording)
    llm = LLM(llama_path, device="cpu", max_model_len=64, kv_cache_space_gib=0.01,
              enable_chunked_prefill=True, max_num_batched_tokens=300)
    assert isinstance(llm.llm_engine.executor.worker, CpuWorker)
    assert steps == [300]  # the budget, under the cap
    steps.clear()
    llm = LLM(llama_path, device="cpu", max_model_len=64, kv_cache_space_gib=0.01,
              enable_chunked_prefill=True, max_num_batched_tokens=WARMUP_MAX_TOKENS + 512)
    assert steps == [WARMUP_MAX_TOKENS]
    out = llm.generate("hello", use_tqdm=False)  # and the engine serves normally after it
    assert len(out[0].outputs[0].token_ids) > 0
