"""P2pConnector: KV blocks between two engine processes, on one host or two, through
torch.distributed (vLLM's PyNcclConnector, by that name too). The scheduler side is here (no
torch at import; the directory client imports torch.distributed when it connects); the
worker side is p2p_worker.py.

    producer: --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer",
                                     "kv_rank": 0, "kv_parallel_size": 2, "kv_ip": "10.0.0.1",
                                     "kv_port": 14579, "kv_buffer_size": 1e9}'
    consumer: the same with "kv_role": "kv_consumer", "kv_rank": 1

- The producer's worker hosts a TCPStore on kv_port (the rendezvous and the *directory*) and
  keeps the blocks its prefix cache gains (a computed prompt's full blocks, saved after the
  step that computed them, before the request's output returns) in a host buffer of
  ``kv_buffer_size`` bytes, the oldest saves dropped first; each key it holds is listed in the
  directory. This side mirrors that buffer (same capacity, same order), so a key is sent once.
- The consumer's ``locate`` asks the directory (its own TCPStore client, kept by a thread that
  reconnects while the producer is away); its worker asks the producer for the rows over a
  2-rank gloo group of its own (never the default process group) and receives them into the
  staging rows. A producer gone, a block no longer held or a transfer past ``timeout_s``: the
  load fails, the engine computes the block (the manager's load_failed path), counted.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections import Counter, OrderedDict
from datetime import timedelta
from typing import Any, ClassVar

from pagedllm.kv_transfer.base import Key, KVStepOps, RemoteStoreConnector, Slot

logger = logging.getLogger(__name__)

STORE = "p2p"
NAMESPACE = "pagedllm-p2p"
RANKS = {"kv_producer": 0, "kv_consumer": 1}
EXTRA_DEFAULTS = {"timeout_s": 5.0, "retry_s": 2.0}
BUFFER_DEVICES = ("cpu",)


def dir_key(rank: int, key: bytes) -> str:
    """The directory entry of ``key`` held by the producer's tensor-parallel rank ``rank``."""
    return f"{NAMESPACE}/r{rank}/k/{key.hex()}"


def p2p_settings(transfer: Any) -> dict[str, Any]:
    """The connector's settings from a KVTransferConfig, validated; ValueError names the field,
    the value and what is allowed."""
    pre = "kv_transfer_config"
    role = transfer.kv_role
    if role not in RANKS:
        raise ValueError(f"{pre}.kv_role={role!r} is not supported by P2pConnector: one engine "
                         "is the kv_producer (kv_rank 0), the other the kv_consumer (kv_rank 1); "
                         "SharedStorageConnector runs kv_both")
    rank = RANKS[role] if transfer.kv_rank is None else transfer.kv_rank
    if rank != RANKS[role]:
        raise ValueError(f"{pre}.kv_rank={transfer.kv_rank!r} is invalid for P2pConnector: "
                         "kv_rank must be 0 for kv_producer, 1 for kv_consumer")
    if transfer.kv_parallel_size != 2:
        raise ValueError(f"{pre}.kv_parallel_size={transfer.kv_parallel_size!r} is invalid for "
                         "P2pConnector: must be 2 (one producer, one consumer)")
    port = transfer.kv_port
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{pre}.kv_port={port!r} is invalid: must be a TCP port, 1-65535")
    if not isinstance(transfer.kv_ip, str) or not transfer.kv_ip:
        raise ValueError(f"{pre}.kv_ip={transfer.kv_ip!r} is invalid: give the producer's "
                         "address (e.g. 127.0.0.1)")
    size = transfer.kv_buffer_size
    if not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"{pre}.kv_buffer_size={size!r} is invalid: must be > 0 (bytes of "
                         "the producer's buffer of blocks)")
    if transfer.kv_buffer_device not in BUFFER_DEVICES:
        raise ValueError(f"{pre}.kv_buffer_device={transfer.kv_buffer_device!r} is not "
                         f"supported by P2pConnector; allowed: {', '.join(BUFFER_DEVICES)} "
                         "(the blocks go through gloo over TCP)")
    extra = dict(transfer.kv_connector_extra_config)
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ValueError(f"{pre}.kv_connector_extra_config has unknown key(s) "
                         f"{', '.join(unknown)} for P2pConnector; known: "
                         f"{', '.join(EXTRA_DEFAULTS)}")
    out = {**EXTRA_DEFAULTS, **extra}
    for name in EXTRA_DEFAULTS:
        value = out[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{pre}.kv_connector_extra_config.{name}={value!r} is invalid: "
                             "must be a number of seconds > 0")
    return {"role": role, "rank": rank, "ip": transfer.kv_ip, "port": port,
            "buffer_size": int(size), "buffer_device": transfer.kv_buffer_device,
            "timeout_s": float(out["timeout_s"]), "retry_s": float(out["retry_s"])}


def open_client(ip: str, port: int, timeout_s: float) -> Any:
    """A TCPStore client of the producer's store; OSError at once when nothing listens there
    (torch's own client would retry and log until ``timeout_s``)."""
    with socket.create_connection((ip, port), timeout=min(timeout_s, 1.0)):
        pass
    from torch.distributed import TCPStore

    return TCPStore(ip, port, None, False, timedelta(seconds=timeout_s))


class Directory:
    """The consumer's view of which keys the producer holds: a TCPStore client, reopened by a
    thread every ``retry_s`` while the producer is unreachable (``locate`` never waits for a
    connection)."""

    def __init__(self, settings: dict[str, Any], ranks: int) -> None:
        self.settings = settings
        self.ranks = ranks
        self.where = f"{settings['ip']}:{settings['port']}"
        self.counters: Counter[str] = Counter()
        self._client: Any = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._open()  # once now (a producer already up is found before the first request)
        self._thread = threading.Thread(target=self._keep_open, name="pagedllm-kv-p2p-dir",
                                        daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _open(self) -> None:
        s = self.settings
        try:
            client = open_client(s["ip"], s["port"], s["timeout_s"])
        except (OSError, RuntimeError) as exc:
            logger.debug("KV producer at %s not reachable: %s", self.where, exc)
            return
        with self._lock:
            self._client = client
        self.counters["connects"] += 1
        logger.info("P2pConnector: found the KV producer at %s", self.where)

    def _keep_open(self) -> None:
        while not self._closed.wait(self.settings["retry_s"]):
            if self._client is None:
                self._open()

    def holds(self, key: bytes) -> bool:
        with self._lock:
            client = self._client
            if client is None:
                return False
            try:
                return client.check([dir_key(r, key) for r in range(self.ranks)])
            except RuntimeError as exc:  # torch.distributed's DistError: the producer is gone
                self._client = None
                self.counters["lost"] += 1
                logger.warning("P2pConnector: lost the KV producer at %s (%s); prompts are "
                               "computed here until it is back", self.where, exc)
                return False

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            self._client = None


class P2pConnector(RemoteStoreConnector):
    name: ClassVar[str] = "P2pConnector"
    worker_class: ClassVar[str] = "pagedllm.kv_transfer.p2p_worker:P2pWorker"

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        super().__init__(config, slots)
        self.settings = p2p_settings(config.kv_transfer_config)
        self.producer = self.settings["role"] == "kv_producer"
        self.capacity = slots.get(STORE, 0)  # the producer's buffer, in blocks
        self._held: OrderedDict[Key, None] = OrderedDict()  # the producer's buffer, mirrored
        self.retry_s = self.settings["retry_s"]  # a failed key is asked again after this
        parallel = getattr(config, "parallel", None)
        self.directory = (None if self.producer else
                          Directory(self.settings, getattr(parallel, "tensor_parallel_size", 1)))

    @classmethod
    def worker_spec(cls, config: Any) -> dict[str, Any]:
        return p2p_settings(config.kv_transfer_config)

    def locate(self, key: Key) -> tuple[str, Slot] | None:
        if self.directory is None:
            return None
        if self.is_broken(key):
            return None
        return (STORE, key) if self.directory.holds(key) else None  # type: ignore[arg-type]

    def on_computed(self, block: int, key: Key, ops: KVStepOps) -> None:
        if not self.producer or key in self._held or not self.capacity:
            return
        self._held[key] = None
        if len(self._held) > self.capacity:  # the worker drops the same, oldest save first
            self._held.popitem(last=False)
        ops.stores.append(("save", STORE, block, key))
        self.counters["saved"] += 1

    def stats(self) -> dict[str, Any]:
        where = {"producer": f"{self.settings['ip']}:{self.settings['port']}"}
        if self.producer:
            return {STORE: {**where, "slots": self.capacity, "resident": len(self._held),
                            **self.counters}}
        assert self.directory is not None
        return {STORE: {**where, "connected": self.directory.connected, **self.counters,
                        **self.directory.counters}}

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
