"""OpenMP thread placement of a cpu worker: ``PAGEDLLM_CPU_OMP_THREADS_BIND`` (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``).

Forms:
- ``auto``: one OpenMP thread per CPU this worker may use (the process's affinity mask, split
  evenly between the ranks of a multi-rank engine), OpenMP thread i bound to the i-th of them;
- ``nobind`` (or vLLM 0.7's ``all``): leave the threads as torch made them (the scheduler
  moves them freely);
- a CPU list ``0-3`` / ``0,2,4-5`` (one thread per listed CPU, in that order), or one list per
  rank separated by ``|`` (``0-1|2-3``: rank 0 gets 0-1, rank 1 gets 2-3).

``apply_thread_binding`` runs once per (process, thread): it sets torch's thread count and binds
the OpenMP pool of the calling thread, which must be the thread that runs the model (libgomp
keeps one pool per thread that starts parallel work; AsyncLLMEngine builds and steps its engine on
one thread for that reason). The binding itself is csrc/cpu/threads_cpu.cpp (``bind_omp_threads``:
one parallel region in which every pool thread calls sched_setaffinity on itself).

Why it matters: a decode step is ~70 OpenMP parallel regions, each ending in a barrier. When
other processes compete for the cores, an OpenMP thread that spins at a barrier (libgomp's default
wait policy) burns the time slice its partner needs, and unbound threads can stack on one core.

The default is ``nobind``, from benchmarks/thread_placement.py on the shared 2-core EPYC (bench99m
bf16, 16 x 200 in / 32 out, decode TPOT median over rounds, relative to nobind in the same load).
With the machine near idle (3 rounds): auto 1.06x, OMP_WAIT_POLICY=PASSIVE 1.20x,
GOMP_SPINCOUNT=10000 1.00x; under two busy loops: auto 0.96x, PASSIVE 0.70x, SPINCOUNT=10000 0.52x.
Under heavy outside load (load average ~8, 2 rounds) auto took 0.45-0.69x but unbound PASSIVE
0.09-0.18x, and bound PASSIVE 0.20-0.29x (a bound thread cannot leave a core another process holds).
So the lever under contention is libgomp's spinning (GOMP_SPINCOUNT / OMP_WAIT_POLICY, read once
when torch is imported, so a launcher must set them: the ``pagedllm`` command does,
entrypoints/omp_env.py), not binding; auto is for dedicated machines.
Binding also narrows what the binding thread hands down: threads and processes it starts later
inherit its one-CPU mask ("auto" in a pagedllm worker started that way widens back, see
``allowed_cpus``).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from pagedllm import envs

logger = logging.getLogger(__name__)

BIND_ENV = "PAGEDLLM_CPU_OMP_THREADS_BIND"
DEFAULT_BIND = "nobind"
ALLOWED_FORMS = ("'auto', 'nobind' (or 'all'), or a CPU list such as '0-3' or '0,2,4-5' (one per "
                 "rank, '|'-separated)")
# the affinity mask a process saw before any binding in it: children spawned by a bound thread
# inherit its one-CPU mask, so "auto" in them starts from this instead
_BEFORE_ENV = "_PAGEDLLM_CPU_AFFINITY_BEFORE_BIND"
_lock = threading.Lock()
_bound: dict[int, tuple[int, ...]] = {}  # thread ident -> the CPUs its pool is bound to


@dataclass(frozen=True)
class BindSpec:
    """A parsed ``PAGEDLLM_CPU_OMP_THREADS_BIND``: mode "auto" | "nobind" | "list"; ``lists``: for
    "list", one tuple of CPU ids per rank (a single list serves every rank)."""
    mode: str
    lists: tuple[tuple[int, ...], ...] = ()


def _parse_cpu_list(text: str, raw: str) -> tuple[int, ...]:
    """'0,2,4-5' -> (0, 2, 4, 5); order kept, duplicates refused."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            first, last = -1, -2
        if first < 0 or last < first:
            raise ValueError(f"{BIND_ENV}={raw!r} is invalid: {part!r} is not a CPU id or range; "
                             f"allowed: {ALLOWED_FORMS}")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{BIND_ENV}={raw!r} is invalid: a CPU appears twice in {text!r}; "
                         f"allowed: {ALLOWED_FORMS}")
    return tuple(cpus)


def parse_bind(raw: str | None) -> BindSpec:
    """The spec of ``raw`` (unset or empty: the default). Raises ValueError naming the variable
    and the allowed forms."""
    value = (raw if raw is not None else "").strip() or DEFAULT_BIND
    if value.lower() in ("auto", "nobind"):
        return BindSpec(value.lower())
    if value.lower() == "all":  # vLLM 0.7's name for "no binding, every CPU"
        return BindSpec("nobind")
    return BindSpec("list", tuple(_parse_cpu_list(part, value) for part in value.split("|")))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may use, sorted: its mask before any binding in this process tree
    where one was recorded (and is still a subset of what the OS allows), else this thread's."""
    current = set(os.sched_getaffinity(0))
    before = envs.get(_BEFORE_ENV) or ""
    if before:
        try:
            recorded = {int(c) for c in before.split(",")}
        except ValueError:
            recorded = set()
        if recorded:
            try:  # widen this thread's mask back (the OS keeps it within the cgroup's CPUs)
                os.sched_setaffinity(0, recorded)
                widened = set(os.sched_getaffinity(0))
                os.sched_setaffinity(0, current)
                return tuple(sorted(widened))
            except OSError:
                pass
    return tuple(sorted(current))


def cpus_for_rank(spec: BindSpec, rank: int, world_size: int) -> tuple[int, ...] | None:
    """The CPUs rank ``rank`` of ``world_size`` binds its threads to; None for nobind (or auto
    with fewer CPUs than ranks, logged)."""
    if spec.mode == "nobind":
        return None
    if spec.mode == "list":
        if len(spec.lists) == 1:
            return spec.lists[0]
        if len(spec.lists) != world_size:
            raise ValueError(f"{BIND_ENV} has {len(spec.lists)} '|'-separated CPU lists but the "
                             f"engine has {world_size} ranks; give one list per rank or a single "
                             f"list; allowed: {ALLOWED_FORMS}")
        return spec.lists[rank]
    cpus = allowed_cpus()
    share = len(cpus) // max(1, world_size)
    if share < 1:
        logger.warning("cpu: %s=auto: %d CPUs for %d ranks; threads left unbound", BIND_ENV,
                       len(cpus), world_size)
        return None
    local = rank % max(1, world_size)
    return cpus[local * share:(local + 1) * share]


def apply_thread_binding(rank: int = 0, world_size: int = 1, raw: str | None = None
                         ) -> tuple[int, ...] | None:
    """Apply ``raw`` (default: $PAGEDLLM_CPU_OMP_THREADS_BIND) to the calling thread's OpenMP pool:
    torch.set_num_threads(len(cpus)) and OpenMP thread i bound to cpus[i]. Returns the CPUs bound
    (None: left unbound). Once per (process, thread); a second call with the same CPUs does
    nothing. Raises ValueError for a bad value, RuntimeError where an explicit list cannot be
    applied (auto falls back to unbound with a warning)."""
    raw = envs.PAGEDLLM_CPU_OMP_THREADS_BIND if raw is None else raw
    spec = parse_bind(raw)
    cpus = cpus_for_rank(spec, rank, world_size)
    if cpus is None:
        logger.info("cpu: OpenMP threads not bound (%s=%s); %d intra-op threads; "
                    "OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s", BIND_ENV, spec.mode, _num_threads(),
                    os.environ.get("OMP_WAIT_POLICY", "<unset>"),
                    os.environ.get("GOMP_SPINCOUNT", "<unset>"))
        return None
    ident = threading.get_ident()
    with _lock:
        if _bound.get(ident) == cpus:
            return cpus
        try:
            tids = _bind(cpus)
        except (RuntimeError, OSError) as exc:
            if spec.mode == "auto":
                logger.warning("cpu: %s=auto: OpenMP threads left unbound (%s)", BIND_ENV, exc)
                return None
            raise RuntimeError(f"{BIND_ENV}={raw!r}: cannot bind the "
                               f"OpenMP threads to CPUs {list(cpus)}: {exc}") from exc
        _bound[ident] = cpus
    logger.info("cpu: %s=%s: %d OpenMP threads bound one per CPU: %s", BIND_ENV,
                spec.mode if spec.mode == "auto" else ",".join(map(str, cpus)), len(cpus),
                ", ".join(f"thread {i} (tid {t}) -> cpu {c}" for i, (t, c)
                          in enumerate(zip(tids, cpus))))
    return cpus


def _num_threads() -> int:
    import torch

    return torch.get_num_threads()


def _bind(cpus: tuple[int, ...]) -> list[int]:
    """torch.set_num_threads(len(cpus)) and bind_omp_threads; the tids of OpenMP threads 0..n-1."""
    import torch

    from pagedllm.backends.cpu.kernels import THREADS, load_cpu_kernels

    ops = load_cpu_kernels(THREADS)
    os.environ.setdefault(_BEFORE_ENV, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    threads = torch.get_num_threads()
    torch.set_num_threads(len(cpus))
    try:
        return list(ops.bind_omp_threads(list(cpus)))
    except RuntimeError:
        torch.set_num_threads(threads)
        raise
