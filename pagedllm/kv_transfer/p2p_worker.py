"""The P2pConnector's worker side (the scheduler side and the protocol's outline: p2p.py).

Per tensor-parallel rank r, under the TCPStore prefix ``pagedllm-p2p/r{r}``:
  row_bytes      the producer's staging row (one block of every layer), checked on connect
  k/<key hex>    the directory: a key the producer's buffer holds
  reqs, req/<i>  requests, numbered by the consumer (``add``), taken in order by the producer's
                 server thread: b"J" + gen (join the 2-rank gloo group ``g<gen>``) or
                 b"R" + gen + n 16-byte keys (send the rows of those keys)
  gens           the consumer's group generations: a failed transfer abandons its group (gloo
                 closes a pair that timed out), the next read joins a new one
Answers go over the group, producer rank 0 to consumer rank 1: uint8 [n] found flags (tag 1),
then uint8 [n, row_bytes] rows, zero where not found (tag 2), received in place into the
staging rows. The control path never blocks on gloo, so a producer's server thread only waits
on the store (in ``POLL_S`` slices, to notice close) and on sends to a consumer that asked.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from pagedllm.kv_transfer.base import Slot
from pagedllm.kv_transfer.keys import KEY_BYTES
from pagedllm.kv_transfer.p2p import NAMESPACE, STORE, dir_key, open_client
from pagedllm.kv_transfer.worker_side import BlockStore, CacheLayout, KVConnectorWorker

logger = logging.getLogger(__name__)

POLL_S = 0.2  # the producer's server thread checks for close this often
STALE_POLLS = 25  # a request number taken but never written is skipped after this many polls
HEADER = struct.Struct("<cq")  # kind, group generation


def _gloo_group(store: Any, rank: int, hostname: str, timeout_s: float) -> ProcessGroupGloo:
    """A 2-rank gloo group over ``store`` (its own rendezvous; not the default group)."""
    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    return ProcessGroupGloo(store, rank, 2, opts)


def _local_address(peer: str, port: int) -> str:
    """This host's address on the route to ``peer`` (gloo binds to it)."""
    family, kind, proto, _, addr = socket.getaddrinfo(peer, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return s.getsockname()[0]


class P2pProducerStore(BlockStore):
    """The producer's buffer: up to ``kv_buffer_size`` bytes of rows by key, the oldest save
    dropped first (the scheduler side mirrors it), listed in the directory it hosts; a server
    thread answers the consumer's requests."""

    def __init__(self, settings: dict[str, Any], layout: CacheLayout) -> None:
        self.name = STORE
        self.row_bytes = layout.row_bytes
        self.num_slots = settings["buffer_size"] // self.row_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_transfer_config.kv_buffer_size={settings['buffer_size']} is "
                             f"smaller than one block of this engine ({self.row_bytes} bytes "
                             "over all layers); give at least that")
        self.rank, self.ns = layout.rank, f"{NAMESPACE}/r{layout.rank}"
        self.settings = settings
        self.where = f"{settings['ip']}:{settings['port']}"
        timeout = timedelta(seconds=settings["timeout_s"])
        try:  # rank 0 hosts the store on kv_port (every interface); other ranks join it
            self._dir = TCPStore(settings["ip"], settings["port"], None, self.rank == 0,
                                 timeout, wait_for_workers=False)
            self._ctl = TCPStore(settings["ip"], settings["port"], None, False, timeout)
        except RuntimeError as exc:
            raise ValueError(f"kv_transfer_config.kv_port={settings['port']}: the P2pConnector "
                             f"producer cannot serve on {self.where} ({exc}); choose a free "
                             "port (and kv_ip an address of this host)") from None
        self._dir.set(f"{self.ns}/row_bytes", str(self.row_bytes))
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> uint8 [row_bytes]
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedllm-kv-p2p-server",
                                        daemon=True)
        self._thread.start()
        logger.info("P2pConnector: KV producer serving %d blocks (%d bytes each) on %s",
                    self.num_slots, self.row_bytes, self.where)

    def write(self, slots: list[Slot], rows: torch.Tensor) -> None:
        added, dropped = [], []
        for key, row in zip(slots, rows):
            copy = row.reshape(-1).clone()
            with self._lock:
                if key in self._rows:
                    continue
                self._rows[key] = copy
                added.append(dir_key(self.rank, key))
                while len(self._rows) > self.num_slots:
                    dropped.append(dir_key(self.rank, self._rows.popitem(last=False)[0]))
        try:
            for name in dropped:
                self._dir.delete_key(name)
            if added:
                self._dir.multi_set(added, [b""] * len(added))
        except RuntimeError as exc:  # unlisted blocks are only not found
            logger.warning("P2pConnector: directory update on %s failed: %s", self.where, exc)

    def read(self, slots: list[Slot], out: torch.Tensor) -> None:
        raise ValueError("a P2pConnector kv_producer does not load blocks")

    # --- the server thread --------------------------------------------------------------
    def _serve(self) -> None:
        group, gen, i, stale = None, 0, 1, 0
        while not self._closed.is_set():
            name = f"{self.ns}/req/{i}"
            try:
                self._ctl.wait([name], timedelta(seconds=POLL_S))
            except RuntimeError:  # nothing yet (or the store is closing)
                try:
                    stale = stale + 1 if self._ctl.add(f"{self.ns}/reqs", 0) > i else 0
                except RuntimeError:
                    stale = 0
                if stale > STALE_POLLS:  # its consumer died between numbering and writing
                    i, stale = i + 1, 0
                continue
            try:
                payload = self._ctl.get(name)
                self._ctl.delete_key(name)
            except RuntimeError as exc:
                logger.warning("P2pConnector: reading request %d failed: %s", i, exc)
                continue
            i, stale = i + 1, 0
            kind, their_gen = HEADER.unpack_from(payload)
            try:
                if kind == b"J":
                    group = None  # dropped before the next one is built
                    group = _gloo_group(PrefixStore(f"{self.ns}/g{their_gen}", self._ctl), 0,
                                        self.settings["ip"], self.settings["timeout_s"])
                    gen = their_gen
                    self.counters["joins"] += 1
                elif kind == b"R" and group is not None and their_gen == gen:
                    self._answer(group, payload[HEADER.size:])
            except RuntimeError as exc:  # the consumer went away or timed out: wait for it
                logger.warning("P2pConnector: serving the KV consumer failed: %s", exc)
                group = None
                self.counters["failed"] += 1

    def _answer(self, group: ProcessGroupGloo, blob: bytes) -> None:
        keys = [blob[j:j + KEY_BYTES] for j in range(0, len(blob), KEY_BYTES)]
        with self._lock:
            found = [self._rows.get(k) for k in keys]
        status = torch.tensor([r is not None for r in found], dtype=torch.uint8)  # [n]
        empty = torch.zeros(self.row_bytes, dtype=torch.uint8)
        rows = torch.stack([r if r is not None else empty for r in found])  # [n, row_bytes]
        group.send([status], 1, 1).wait()
        group.send([rows], 1, 2).wait()
        self.counters["sent_blocks"] += int(status.sum())

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self.settings["timeout_s"] + 2 * POLL_S)
        with self._lock:
            self._rows.clear()
        self._ctl = self._dir = None  # the last reference to the server: the port is freed


class P2pConsumerStore(BlockStore):
    """The consumer's side: reads ask the producer for rows by key (no slots of its own)."""

    def __init__(self, settings: dict[str, Any], layout: CacheLayout) -> None:
        self.name = STORE
        self.num_slots = 0
        self.row_bytes = layout.row_bytes
        self.ns = f"{NAMESPACE}/r{layout.rank}"
        self.settings = settings
        self.where = f"{settings['ip']}:{settings['port']}"
        self.timeout = timedelta(seconds=settings["timeout_s"])
        self._client: Any = None
        self._group: ProcessGroupGloo | None = None
        self._gen = 0
        self._down_until = 0.0  # reads fail at once until then (a transfer just failed)

    def write(self, slots: list[Slot], rows: torch.Tensor) -> None:
        raise ValueError("a P2pConnector kv_consumer does not save blocks")

    def _request(self, kind: bytes, body: bytes = b"") -> None:
        i = self._client.add(f"{self.ns}/reqs", 1)
        self._client.set(f"{self.ns}/req/{i}", HEADER.pack(kind, self._gen) + body)

    def _connect(self) -> None:
        s = self.settings
        if self._client is None:
            self._client = open_client(s["ip"], s["port"], s["timeout_s"])
            theirs = int(self._client.get(f"{self.ns}/row_bytes"))
            if theirs != self.row_bytes:
                self._client = None
                raise RuntimeError(f"the producer's blocks are {theirs} bytes, this engine's "
                                   f"{self.row_bytes}: run the same model, dtypes and "
                                   "block size on both")
        if self._group is None:
            self._gen = self._client.add(f"{self.ns}/gens", 1)
            self._request(b"J")
            self._group = _gloo_group(PrefixStore(f"{self.ns}/g{self._gen}", self._client), 1,
                                      _local_address(s["ip"], s["port"]), s["timeout_s"])

    def read(self, slots: list[Slot], out: torch.Tensor) -> None:
        n = len(slots)
        if time.monotonic() < self._down_until:
            raise RuntimeError(f"P2pConnector: the KV producer at {self.where} failed a "
                               f"transfer less than {self.settings['retry_s']} s ago")
        status = torch.empty(n, dtype=torch.uint8)
        rows = out.view(n, self.row_bytes)  # received in place
        try:
            self._connect()
            self._request(b"R", b"".join(slots))
            got_status = self._group.recv([status], 0, 1)
            got_rows = self._group.recv([rows], 0, 2)
            got_status.wait(self.timeout)
            got_rows.wait(self.timeout)
        except (OSError, RuntimeError) as exc:
            self._client = self._group = None
            self._down_until = time.monotonic() + self.settings["retry_s"]
            raise RuntimeError(f"P2pConnector: transfer of {n} blocks from the KV producer at "
                               f"{self.where} failed: {exc}") from None
        missing = n - int(status.sum())
        if missing:
            raise ValueError(f"the KV producer at {self.where} no longer holds {missing} of "
                             f"{n} blocks asked for")

    def close(self) -> None:
        self._client = self._group = None


class P2pWorker(KVConnectorWorker):
    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        super().__init__(config, spec, layout)
        store = P2pProducerStore if spec["role"] == "kv_producer" else P2pConsumerStore
        self.stores[STORE] = store(spec, layout)
