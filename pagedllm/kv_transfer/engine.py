"""The engine's side of KV connectors and offload tiers: opens them when the engine starts,
lands each step's loads (and learns which failed), hands a producer's saves to the workers
after the step, and reports counters and the idle invariants."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from pagedllm.kv_transfer.base import KVConnector
from pagedllm.kv_transfer.registry import resolve_connector
from pagedllm.kv_transfer.scheduler_side import KVConnectorManager

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.executor.base import Executor

logger = logging.getLogger(__name__)


def kv_namespace(config: EngineConfig) -> str:
    """What else than the tokens decides a block's KV: the root of every content key
    (kv_transfer/keys.py), so two engines share blocks only when these agree."""
    m, c, p = config.model, config.cache, config.parallel
    return "|".join(map(str, (os.path.realpath(m.model), m.dtype, m.quantization, c.cache_dtype,
                              c.block_size, p.tensor_parallel_size, config.device,
                              config.attention_backend)))


class KVTransferEngine:
    """Created by LLMEngine when ``kv_offload_config`` or ``kv_transfer_config`` is set."""

    def __init__(self, config: EngineConfig, executor: Executor,
                 schedulers: list[Scheduler]) -> None:
        classes: list[type[KVConnector]] = []
        if config.kv_offload_config is not None:
            classes.append(resolve_connector("OffloadingConnector"))
        if config.kv_transfer_config is not None:
            classes.append(resolve_connector(config.kv_transfer_config.kv_connector))
        self.executor = executor
        self.schedulers = schedulers
        specs = [(cls.worker_class, cls.worker_spec(config)) for cls in classes]
        per_rank = executor.kv_connector_call("init", specs)
        slots = {name: min(r[name] for r in per_rank) for name in per_rank[0]}
        self.connectors = [cls(config, slots) for cls in classes]
        self.manager = KVConnectorManager(schedulers[0].block_manager, self.connectors)
        schedulers[0].kv = self.manager
        logger.info("KV connectors: %s; stores (blocks): %s",
                    ", ".join(c.name for c in self.connectors),
                    ", ".join(f"{k} {v}" for k, v in slots.items()) or "none")

    @classmethod
    def create(cls, config: EngineConfig, executor: Executor,
               schedulers: list[Scheduler]) -> KVTransferEngine | None:
        if config.kv_offload_config is None and config.kv_transfer_config is None:
            return None
        return cls(config, executor, schedulers)

    def after_step(self, done: Any) -> None:
        """After a step: its loads land (failed ones are computed instead), moves recorded
        since the schedule (a producer's saves of computed blocks) run on the workers now,
        and at idle the landed blocks are unpinned."""
        ops = done.sched.batch.kv_ops if done is not None else None
        failed: list = []
        if ops is not None and ops.loads:
            failed = [f for rank in self.executor.kv_connector_call("take_failed") for f in rank]
        self.manager.land(ops, failed)
        pending = self.manager.take_pending()
        if pending is not None:
            self.executor.kv_connector_call("apply", pending.for_workers())
        if not any(s.has_unfinished() for s in self.schedulers):
            self.manager.release_landed()

    def stats(self) -> dict[str, Any]:
        """The scheduler side's counters and residency, and the workers' bytes and load
        latencies (rank 0's)."""
        out = self.manager.stats()
        out["workers"] = self.executor.kv_connector_call("stats")[0]
        return out

    def check_idle(self) -> list[str]:
        return self.manager.check_idle()

    def shutdown(self) -> None:
        try:
            self.executor.kv_connector_call("close")
        except Exception as exc:  # the workers may be gone already
            logger.debug("closing KV connectors: %s", exc)
