"""The P2pConnector's worker side (the scheduler side and the protocol's outline: p2p.py).

Per tensor-parallel rank r, under the TCPStore prefix ``pagedllm-p2p/r{r}``:
  row_bytes      the producer's staging row (one block of every layer), checked on connect
  ctl            "host:port" of the producer's control socket
  k/<key hex>    the directory: a key the producer's buffer holds
  gens           the consumer's group generations; ``g<gen>/...`` the gloo rendezvous
The consumer connects to the control socket and sends frames (4-byte length, then HEADER and
a body): b"J" + gen (join the 2-rank gloo group ``g<gen>``, built over the store), or b"R" +
gen + n 16-byte keys (send their rows). The producer answers a request over the group, rank 0
to rank 1: uint8 [n] found flags (tag 1), then uint8 [n, row_bytes] rows, zero where not
found (tag 2), which the consumer receives in place into its staging rows. A failed transfer
drops the group and the connection (gloo closes a pair that timed out); the next read
connects again with a new generation. The producer's server thread waits in ``select`` (a
closed consumer is seen at once; close is noticed within ``POLL_S``), never in gloo.
"""
from __future__ import annotations

import logging
import select
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
HEADER = struct.Struct("<cq")  # kind, group generation
LENGTH = struct.Struct("<I")  # a frame's length


def _send_frame(sock: socket.socket, kind: bytes, gen: int, body: bytes = b"") -> None:
    data = HEADER.pack(kind, gen) + body
    sock.sendall(LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the KV consumer closed the connection")
        buf += chunk
    return bytes(buf)


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
            self._listener = socket.create_server((settings["ip"], 0))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"kv_transfer_config.kv_port={settings['port']}: the P2pConnector "
                             f"producer cannot serve on {self.where} ({exc}); choose a free "
                             "port (and kv_ip an address of this host)") from None
        host, port = self._listener.getsockname()[:2]
        self._dir.multi_set([f"{self.ns}/row_bytes", f"{self.ns}/ctl"],
                            [str(self.row_bytes), f"{host}:{port}"])
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
        conn: socket.socket | None = None
        group, gen = None, 0
        while not self._closed.is_set():
            waiting = [self._listener] + ([conn] if conn is not None else [])
            try:
                ready = select.select(waiting, [], [], POLL_S)[0]
                if self._listener in ready:  # a (re)connected consumer replaces the last one
                    if conn is not None:
                        conn.close()
                    conn, group = self._listener.accept()[0], None
                    conn.settimeout(self.settings["timeout_s"])
                    continue
                if conn is None or conn not in ready:
                    continue
                frame = _recv_exact(conn, LENGTH.unpack(_recv_exact(conn, LENGTH.size))[0])
                kind, their_gen = HEADER.unpack_from(frame)
                if kind == b"J":
                    group = None  # dropped before the next one is built
                    group = _gloo_group(PrefixStore(f"{self.ns}/g{their_gen}", self._dir), 0,
                                        self.settings["ip"], self.settings["timeout_s"])
                    gen = their_gen
                    self.counters["joins"] += 1
                elif kind == b"R" and group is not None and their_gen == gen:
                    self._answer(group, frame[HEADER.size:])
            except (OSError, RuntimeError) as exc:  # the consumer went away or timed out
                if conn is not None and not isinstance(exc, ConnectionError):
                    logger.warning("P2pConnector: serving the KV consumer failed: %s", exc)
                    self.counters["failed"] += 1
                if conn is not None:
                    conn.close()
                conn = group = None
        if conn is not None:
            conn.close()

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
        self._listener.close()
        with self._lock:
            self._rows.clear()
        self._dir = None  # the last reference to the store's server: kv_port is free again


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
        self._conn: socket.socket | None = None
        self._group: ProcessGroupGloo | None = None
        self._gen = 0
        self._down_until = 0.0  # reads fail at once until then (a transfer just failed)

    def write(self, slots: list[Slot], rows: torch.Tensor) -> None:
        raise ValueError("a P2pConnector kv_consumer does not save blocks")

    def _connect(self) -> None:
        s = self.settings
        if self._group is not None:
            return
        self._client = open_client(s["ip"], s["port"], s["timeout_s"])
        theirs, ctl = self._client.multi_get([f"{self.ns}/row_bytes", f"{self.ns}/ctl"])
        if int(theirs) != self.row_bytes:
            raise RuntimeError(f"the producer's blocks are {int(theirs)} bytes, this engine's "
                               f"{self.row_bytes}: run the same model, dtypes and block size "
                               "on both")
        host, _, port = ctl.decode().rpartition(":")
        self._conn = socket.create_connection((host, int(port)), timeout=s["timeout_s"])
        self._gen = self._client.add(f"{self.ns}/gens", 1)
        _send_frame(self._conn, b"J", self._gen)
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
            assert self._conn is not None and self._group is not None
            _send_frame(self._conn, b"R", self._gen, b"".join(slots))
            got_status = self._group.recv([status], 0, 1)
            got_rows = self._group.recv([rows], 0, 2)
            got_status.wait(self.timeout)
            got_rows.wait(self.timeout)
        except (OSError, RuntimeError) as exc:
            self.close()
            self._down_until = time.monotonic() + self.settings["retry_s"]
            raise RuntimeError(f"P2pConnector: transfer of {n} blocks from the KV producer at "
                               f"{self.where} failed: {exc}") from None
        missing = n - int(status.sum())
        if missing:
            raise ValueError(f"the KV producer at {self.where} no longer holds {missing} of "
                             f"{n} blocks asked for")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._client = self._conn = self._group = None


class P2pWorker(KVConnectorWorker):
    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        super().__init__(config, spec, layout)
        store = P2pProducerStore if spec["role"] == "kv_producer" else P2pConsumerStore
        self.stores[STORE] = store(spec, layout)
