"""The engine's side of KV connectors and offload tiers: opens them when the engine starts,
lands each step's loads (and learns which failed), hands a producer's saves to the workers
after the step, keeps the counters (hits, bytes and residency per tier, load latency), logs
hit rates, and checks the idle invariants."""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from pagedllm.kv_transfer.base import KVConnector
from pagedllm.kv_transfer.registry import resolve_connector
from pagedllm.kv_transfer.scheduler_side import KVConnectorManager

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.executor.base import Executor

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0  # hit rates are logged at most this often, after activity


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
        self.block_size = config.cache.block_size
        specs = [(cls.worker_class, cls.worker_spec(config)) for cls in classes]
        per_rank = executor.kv_connector_call("init", specs)
        slots = {name: min(r["slots"][name] for r in per_rank) for name in per_rank[0]["slots"]}
        self.row_bytes = per_rank[0]["row_bytes"]  # one block of every layer
        self.connectors = [cls(config, slots) for cls in classes]
        self.manager = KVConnectorManager(schedulers[0].block_manager, self.connectors)
        schedulers[0].kv = self.manager
        self.load_seconds: list[float] = []  # load latencies not yet taken by stats()
        self.num_loads, self.load_seconds_sum = 0, 0.0
        self._logged_at, self._logged_queried = time.monotonic(), 0
        logger.info("KV connectors: %s; stores (blocks of %d bytes): %s",
                    ", ".join(c.name for c in self.connectors), self.row_bytes,
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
        and at idle the landed blocks are unpinned and the moves meant for the next step
        (write-through saves) are queued on the workers."""
        ops = done.sched.batch.kv_ops if done is not None else None
        failed: list = []
        if ops is not None and (ops.loads or ops.ready_loads):
            for rank_failed, seconds in self.executor.kv_connector_call("take_load_results"):
                failed += rank_failed
                self.load_seconds += seconds
                self.num_loads += len(seconds)
                self.load_seconds_sum += sum(seconds)
            del self.load_seconds[:-4096]
        self.manager.land(ops, failed)
        pending = self.manager.take_pending()
        if pending is not None:
            self.executor.kv_connector_call("apply", pending.for_workers())
        if not any(s.has_unfinished() for s in self.schedulers):
            self.manager.release_landed()
            idle = self.manager.take_deferred()  # no next step to carry them: queue them now
            if idle is not None:
                self.executor.kv_connector_call("queue", idle.for_workers())
        if time.monotonic() - self._logged_at > LOG_INTERVAL_S:
            self._log_rates()

    def hit_rates(self) -> dict[str, float]:
        """Of the full prompt blocks asked about: the fraction found in the device cache and
        the fraction loaded from each store."""
        c = self.manager.counters
        queried = c.get("queried", 0)
        if not queried:
            return {}
        rates = {"device": c.get("device", 0) / queried}
        for key, n in c.items():
            if key.startswith("loaded:"):
                rates[key[7:]] = n / queried
        return rates

    def _log_rates(self) -> None:
        self._logged_at = time.monotonic()
        queried = self.manager.counters.get("queried", 0)
        if queried == self._logged_queried:
            return
        self._logged_queried = queried
        logger.info("%s", self.summary())

    def summary(self) -> str:
        """One line: hit rates per tier, residency, bytes moved, load latency."""
        stats = self.stats()
        rates = ", ".join(f"{k} {v:.1%}" for k, v in self.hit_rates().items())
        tiers = "; ".join(f"{name} {t['resident']}/{t['slots']} blocks resident"
                          for c in self.connectors for name, t in c.stats().items()
                          if "resident" in t)
        mib = 1 << 20
        moved = ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in stats["bytes"].items())
        latency = (f"; load {1e3 * self.load_seconds_sum / self.num_loads:.2f} ms mean"
                   if self.num_loads else "")
        return (f"KV prefix hits of {self.manager.counters.get('queried', 0)} prompt blocks: "
                f"{rates or 'none'}; {tiers or 'no tiers'}; {moved or 'nothing moved'}{latency}")

    def stats(self) -> dict[str, Any]:
        """Counters (blocks), bytes moved per store and direction, residency per store,
        hit rates, and the load latencies since the previous call (taken)."""
        out = self.manager.stats()
        out["bytes"] = {k: v * self.row_bytes for k, v in out["counters"].items()
                        if k.split(":")[0] in ("loaded", "saved")}
        out["hit_rates"] = self.hit_rates()
        out["load_seconds"], self.load_seconds = self.load_seconds, []
        out["num_loads"], out["load_seconds_sum"] = self.num_loads, self.load_seconds_sum
        return out

    def check_idle(self) -> list[str]:
        return self.manager.check_idle()

    def shutdown(self) -> None:
        if self.num_loads or self.manager.counters:
            logger.info("%s", self.summary())
        try:
            self.executor.kv_connector_call("close")
        except Exception as exc:  # the workers may be gone already
            logger.debug("closing KV connectors: %s", exc)
        for connector in self.connectors:
            connector.close()
