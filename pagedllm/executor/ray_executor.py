"""Tensor and pipeline parallelism over a Ray cluster: one actor per rank (pp_rank * tp_size +
tp_rank), placed by a placement group.

Ray is joined the usual way: a ``ray.init(...)`` made before the engine starts is used as is;
otherwise ``ray.init()`` connects to the cluster in ``RAY_ADDRESS`` (or one started with
``ray start --head`` on this machine) or starts a local one, which is stopped again on shutdown.
Each rank takes one bundle of the device's Ray resource ("GPU" for cuda/rocm, "CPU" on the
cpu; a backend may name another with a ``ray_resource`` attribute). Rank 0's node hosts the
torch.distributed rendezvous. Every actor also runs a never-returning ``wait_until_dead`` call
in a separate concurrency group: its result resolves only when the actor dies, so waiting on
it alongside each step's results turns an actor death into a WorkerDiedError, not a hang.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.distributed.errors import WorkerDiedError, WorkerError
from pagedllm.distributed.utils import (available_cpus, forwarded_env, get_open_port,
                                        worker_num_threads)
from pagedllm.distributed.worker_wrapper import WorkerSpec, WorkerWrapper
from pagedllm.executor.base import MultiWorkerExecutor
from pagedllm.worker.pending import PendingOutputs

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _exc:  # pragma: no cover - exercised only without ray
    raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]' "
                      "(or pip install ray), or use distributed_executor_backend='mp' on one "
                      "host") from _exc

logger = logging.getLogger(__name__)

# a torch device type -> the Ray resource its ranks reserve (a backend may override)
RAY_RESOURCES = {"cuda": "GPU", "xla": "TPU", "cpu": "CPU"}
CLOSE_TIMEOUT_S = 5.0
DEATH_GRACE_S = 1.0


class RayWorker(WorkerWrapper):
    """The actor: a WorkerWrapper plus what the driver asks of a Ray node."""

    def describe(self) -> dict[str, Any]:
        return dict(node_id=ray.get_runtime_context().get_node_id(),
                    ip=ray.util.get_node_ip_address(), cpus=available_cpus(), pid=os.getpid())

    def free_port(self) -> int:
        return get_open_port("0.0.0.0")

    @ray.method(concurrency_group="monitor")
    def wait_until_dead(self) -> None:
        threading.Event().wait()  # never returns: the driver watches for this call's failure


RayWorkerActor = ray.remote(concurrency_groups={"monitor": 1})(RayWorker)


def ray_resource(backend: Backend) -> str:
    explicit = getattr(backend, "ray_resource", None)
    if explicit:
        return str(explicit)
    if backend.torch_device not in RAY_RESOURCES:
        raise ValueError(f"the {backend.name} backend does not say which Ray resource its "
                         f"devices are; give its Backend class a ray_resource attribute")
    return RAY_RESOURCES[backend.torch_device]


@dataclass
class _RayResources:
    """What the executor holds in Ray; released once, by shutdown() or the finalizer."""

    owns_ray: bool
    actors: list[Any] = field(default_factory=list)
    pg: Any = None

    def release(self, graceful: bool) -> None:
        """Stop the actors, free the placement group, leave Ray if we joined it ourselves."""
        if not ray.is_initialized():
            return
        try:
            if graceful and self.actors:
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors),
                         timeout=CLOSE_TIMEOUT_S)
            for a in self.actors:
                ray.kill(a, no_restart=True)
            if self.pg is not None:
                remove_placement_group(self.pg)
        except Exception as exc:  # Ray may already be shutting down (interpreter exit)
            logger.debug("releasing Ray workers: %s", exc)
        if self.owns_ray:
            ray.shutdown()


class _RaySubmitted(PendingOutputs):
    """A submitted step's object refs; ``result()`` waits for them (or an actor's death)."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        super().__init__([])
        self._executor, self._refs = executor, refs

    def result(self) -> list[SeqOutput]:
        if self._refs is not None:
            ex = self._executor
            if ex._error is not None:
                raise WorkerError(f"the workers failed earlier ({ex._error}); the engine must "
                                  "be restarted") from ex._error
            self._outputs = ex._gather(self._refs, "execute_step")[ex.output_rank] or []
            self._refs = None
        return self._outputs


class RayExecutor(MultiWorkerExecutor):
    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        super().__init__(config, backend)
        n = config.parallel.world_size  # tensor_parallel_size * pipeline_parallel_size
        self.world_size = n
        self._error: BaseException | None = None
        self._sentinels: list[Any] = []
        self.pids: list[int] = []
        self._res = _RayResources(owns_ray=not ray.is_initialized())
        if self._res.owns_ray:
            ray.init()
        self.actors = self._res.actors
        self._finalizer = weakref.finalize(self, self._res.release, False)
        try:
            self._start(config, backend)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, backend: Backend) -> None:
        n = self.world_size
        resource = ray_resource(backend)
        have = ray.cluster_resources().get(resource, 0)
        if have < n:
            p = config.parallel
            raise RuntimeError(f"tensor_parallel_size={p.tensor_parallel_size} x "
                               f"pipeline_parallel_size={p.pipeline_parallel_size} needs {n} x "
                               f"{resource} but the Ray cluster has {have:g}; add nodes or lower "
                               f"the parallel sizes")
        pg = self._res.pg = placement_group([{resource: 1}] * n, strategy="PACK")
        timeout_s = envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(f"Ray could not place {n} bundles of {{{resource!r}: 1}} within "
                               f"{timeout_s:g} s (PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S); "
                               f"free resources: {ray.available_resources()}")
        env = forwarded_env()
        for rank in range(n):
            if resource == "GPU":
                amounts: dict[str, Any] = dict(num_cpus=0, num_gpus=1)
            elif resource == "CPU":
                amounts = dict(num_cpus=1)
            else:
                amounts = dict(num_cpus=0, resources={resource: 1})
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                        placement_group_bundle_index=rank)
            self.actors.append(RayWorkerActor.options(
                scheduling_strategy=strategy, runtime_env={"env_vars": env},
                **amounts).remote())
        self._sentinels = [a.wait_until_dead.remote() for a in self.actors]
        info = self._gather([a.describe.remote() for a in self.actors], "describe")
        self.pids = [i["pid"] for i in info]
        per_node = Counter(i["node_id"] for i in info)
        port = self._gather([self.actors[0].free_port.remote()], "free_port", ranks=[0])[0]
        init_method = f"tcp://{info[0]['ip']}:{port}"
        specs = [WorkerSpec(config, backend, rank, n, init_method,
                            worker_num_threads(per_node[i["node_id"]], i["cpus"]), env)
                 for rank, i in enumerate(info)]
        self._gather([a.init_worker.remote(s) for a, s in zip(self.actors, specs)], "init_worker")
        logger.info("started %d Ray workers on %d node(s) (%s, rendezvous %s)", n, len(per_node),
                    backend.dist_backend, init_method)

    # --- the Executor interface ----------------------------------------------------------
    def _pack(self, batch: ScheduledBatch) -> object:
        return ray.put(super()._pack(batch))  # one object-store copy shared by every actor

    def check_health(self) -> None:
        """Raise if an actor is gone (looks only at the death watches; safe during a step)."""
        if self._error is not None:
            raise self._error
        done, _ = ray.wait(list(self._sentinels), num_returns=1, timeout=0)
        if done:
            rank = self._sentinels.index(done[0])
            raise WorkerDiedError(f"worker rank {rank} died (Ray actor, pid {self.pids[rank]})")

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            self._res.release(graceful=self._error is None)

    def submit(self, batch: ScheduledBatch) -> PendingOutputs:
        """Queue the step on every actor and return: an actor runs its calls in order, so with
        pipeline stages stage i runs this step while stage i+1 still runs the one before."""
        if self._error is not None:
            raise WorkerError(f"the workers failed earlier ({self._error}); the engine must be "
                              "restarted") from self._error
        packed = self._pack(batch)
        return _RaySubmitted(self, [a.execute_step.remote(packed) for a in self.actors])

    # --- calls ---------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> list[Any]:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers failed earlier ({self._error}); "
                              "the engine must be restarted") from self._error
        if not self._finalizer.alive:
            raise RuntimeError("the executor was shut down")
        return self._gather([getattr(a, method).remote(*args) for a in self.actors], method)

    def _gather(self, refs: list[Any], method: str, ranks: list[int] | None = None) -> list[Any]:
        """Results in rank order; an actor death (any rank's) ends the wait at once."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        results: list[Any] = [None] * len(refs)
        pending = {ref: (i, rank) for i, (ref, rank) in enumerate(zip(refs, ranks))}
        watch = {ref: rank for rank, ref in enumerate(self._sentinels)}
        while pending:
            ready, _ = ray.wait([*pending, *watch], num_returns=1)
            ref = ready[0]
            if ref in watch:
                self._fail(self._died(watch[ref], method))
            i, rank = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except RayActorError as exc:
                self._fail(self._died(rank, method, exc))
            except RayTaskError as exc:
                self._fail(self._dead_peer(method, rank) or exc)
        return results

    def _died(self, rank: int, method: str, cause: BaseException | None = None) -> WorkerDiedError:
        if cause is None:
            try:
                ray.get(self._sentinels[rank])
            except Exception as exc:
                cause = exc
        text = str(cause).strip() if cause is not None else ""
        first_line = text.splitlines()[0].rstrip(".") if text else "no detail"
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        return WorkerDiedError(f"worker rank {rank} died (Ray actor, pid {pid}) during {method}: "
                               f"{first_line}. The engine cannot continue; restart it")

    def _dead_peer(self, method: str, reporter: int) -> WorkerDiedError | None:
        """After one rank raises, a peer that died is the likelier cause."""
        others = [ref for rank, ref in enumerate(self._sentinels) if rank != reporter]
        if not others:
            return None
        done, _ = ray.wait(others, num_returns=1, timeout=DEATH_GRACE_S)
        return self._died(self._sentinels.index(done[0]), method) if done else None

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.shutdown()
        raise error

