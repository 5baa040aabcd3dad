"""A Mooncake-compatible ``TransferEngine`` on top of :class:`transfer_engine.Engine`.

Code written for Mooncake's Python engine runs on ours by changing one import::

    # from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify
    from transfer_engine.connectors.mooncake_compat import (
        TransferEngine, TransferOpcode, TransferNotify)

Method names, arguments and return codes follow Mooncake's documented Python API
(``mooncake.engine``): methods return ``0`` on success and a negative code on failure
(never raise), ``transfer_check_status`` returns ``1`` done / ``0`` in progress / ``-1``
failed / ``-2`` timed out, ``allocate_managed_buffer`` returns an address or ``0``.
This is the one place in the project where errors become integers: the mapping lives in
:func:`_code`, and the reason of each failure is logged at WARNING level.

How Mooncake's ideas map onto ours:

- *Session id* (``target_hostname``): ``"host:rpc_port"`` of the peer; it is the peer
  engine's control endpoint ``tcp://host:port``. Peers are connected lazily on first use
  and cached.
- *Metadata server*: only ``"P2PHANDSHAKE"`` (or ``metadata_type="p2p"``) is supported;
  our engines handshake peer to peer. Anything else returns ``ERR_METADATA``.
- *Raw peer addresses*: Mooncake names remote memory by the peer's virtual address; we
  name it by (segment, offset). Memory registered here gets a segment named
  ``mc:<hex base address>`` so that a peer can map an address to the segment containing
  it and the offset into it. (An engine change would make this unnecessary: see the
  connectors' notes; the mapping is kept inside this module.)
- *Local buffers* that were never registered are registered for the duration of one
  transfer (Mooncake's TCP transport accepts them too; its RDMA transport does not).
- *Protocol*: ``"tcp"`` uses our TCP transport only, ``"rdma"`` RDMA only (initialise
  fails with ``ERR_DEVICE_NOT_FOUND`` where there is none), ``"shm"`` same-host shared
  memory with TCP as fallback, ``""``/``"auto"`` our default choice.
- *Timeouts*: ``MC_TRANSFER_TIMEOUT`` (seconds, default 30) bounds every transfer and
  handshake, as in Mooncake.
- *Notifications*: ``TransferNotify(name, msg)`` travels as the transfer's notification
  and comes out of the peer's ``get_notifies()`` once every byte has landed.

Not supported here (they return/raise as Mooncake does when built without the feature):
the ``*_on_cuda`` calls raise ``RuntimeError``; etcd/HTTP metadata servers.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from transfer_engine.descriptor import Descriptor
from transfer_engine.engine import Engine
from transfer_engine.errors import (
    ConnectError,
    NotSupportedError,
    RegistrationError,
    TransferEngineError,
    TransferTimeout,
)
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_DEVICE_NOT_FOUND",
           "ERR_ADDRESS_OVERLAPPED", "ERR_DNS", "ERR_SOCKET", "ERR_REJECT_HANDSHAKE",
           "ERR_METADATA", "ERR_MEMORY", "ERR_NOT_IMPLEMENTED"]

log = logging.getLogger(__name__)

# Mooncake's error.h codes, where one fits; -1 otherwise (as Mooncake's binding does).
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_REJECT_HANDSHAKE = -104
ERR_METADATA = -200
ERR_MEMORY = -302
ERR_NOT_IMPLEMENTED = -303

# transfer_check_status results
STATUS_COMPLETED = 1
STATUS_PENDING = 0
STATUS_FAILED = -1
STATUS_TIMEOUT = -2

_SEGMENT_PREFIX = "mc:"  # mc:<hex base address>: how a peer maps raw addresses
_NOTIFY_MAGIC = b"\x00mcn1"  # notification payloads made by TransferNotify
_PROTOCOLS: dict[str, tuple[str, ...] | None] = {
    "tcp": ("tcp",), "rdma": ("rdma",), "shm": ("shm", "tcp"), "": None, "auto": None,
}


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode``."""

    READ = 0
    WRITE = 1


class TransferNotify:
    """Mooncake's ``TransferNotify``: a ``name`` and a ``msg`` delivered to the peer after
    every byte of the transfer landed."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TransferNotify) and other.name == self.name
                and other.msg == self.msg)

    def __hash__(self) -> int:
        return hash((self.name, self.msg))

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def _encode(self) -> bytes:
        return _NOTIFY_MAGIC + bytes(msgpack.packb([self.name, self.msg]))

    @classmethod
    def _decode(cls, peer: str, payload: bytes) -> TransferNotify:
        if payload.startswith(_NOTIFY_MAGIC):
            try:
                name, msg = msgpack.unpackb(payload[len(_NOTIFY_MAGIC):])
                return cls(str(name), str(msg))
            except (ValueError, TypeError, msgpack.UnpackException):
                pass
        return cls(peer, payload.decode("utf-8", errors="replace"))


class _Failed(Exception):
    """Internal: a call fails with ``code``; ``str`` says why (logged, never raised out)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def _code(exc: BaseException) -> int:
    """The Mooncake return code for an error of ours (one translation point)."""
    if isinstance(exc, _Failed):
        return exc.code
    if isinstance(exc, ConnectError | TransferTimeout):
        return ERR_SOCKET
    if isinstance(exc, RegistrationError):
        return ERR_INVALID_ARGUMENT
    if isinstance(exc, NotSupportedError):
        return ERR_NOT_IMPLEMENTED
    return ERR_INVALID_ARGUMENT


@dataclass(eq=False)
class _Batch:
    """One submitted batch: its handle, the temporary segments it holds, its deadline."""

    handle: TransferHandle | None
    deadline: float
    temps: list[Segment] = field(default_factory=list)
    error: str | None = None


class _AddressMap:
    """Sorted ``(base, end, segment)`` ranges: which segment holds an address."""

    def __init__(self, ranges: Sequence[tuple[int, int, Any]] = ()) -> None:
        self._ranges = sorted(ranges, key=lambda r: r[0])
        self._bases = [r[0] for r in self._ranges]

    def find(self, address: int, length: int) -> tuple[Any, int] | None:
        """The segment containing ``[address, address + length)`` and the offset."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            return None
        base, end, seg = self._ranges[i]
        if address + length > end:
            return None
        return seg, address - base

    def overlaps(self, address: int, length: int) -> bool:
        end = address + length
        i = bisect.bisect_left(self._bases, end) - 1
        return i >= 0 and self._ranges[i][1] > address

    def first(self) -> Any | None:
        return min((r[2] for r in self._ranges), key=lambda s: s.id, default=None)


def _remote_map(peer: Peer) -> _AddressMap:
    ranges = []
    for seg in peer.segments.values():
        if seg.name.startswith(_SEGMENT_PREFIX):
            try:
                base = int(seg.name[len(_SEGMENT_PREFIX):], 16)
            except ValueError:
                continue
            ranges.append((base, base + seg.length, seg))
    return _AddressMap(ranges)


def _split_hostport(text: str) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"[v6]:port"`` -> (host, port or 0)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:] else 0
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port) if port else 0
    return text, 0  # bare host or bare IPv6 address


class TransferEngine:
    """Mooncake's ``mooncake.engine.TransferEngine`` API over our :class:`Engine`.

    Construct, then :meth:`initialize`; every other call before that returns a negative
    code. :meth:`close` (or a ``with`` block) releases the engine; Mooncake code that
    never closes gets the release at garbage collection, with a ``ResourceWarning``.
    """

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._lock = threading.RLock()
        self._local: dict[int, Segment] = {}  # base address -> registered segment
        self._local_map = _AddressMap()
        self._managed: dict[int, tuple[np.ndarray, Segment]] = {}
        self._peers: dict[str, Peer] = {}
        self._maps: dict[str, _AddressMap] = {}
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._session_host = ""
        self._timeout = 30.0

    # --- initialisation ---------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Starts the engine listening on ``local_hostname`` (``"host"`` or
        ``"host:port"``; port 0 or none picks a free one, see :meth:`get_rpc_port`).
        Returns 0, or a negative code."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name,
                                   "p2p" if metadata_server.upper() == "P2PHANDSHAKE"
                                   else "")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        with self._lock:
            if self._engine is not None:
                log.warning("initialize: already initialised")
                return ERR_INVALID_ARGUMENT
            if metadata_server.upper() != "P2PHANDSHAKE" and metadata_type.lower() != "p2p":
                log.warning("initialize: metadata server %r is not supported; use "
                            "'P2PHANDSHAKE' (engines handshake peer to peer)",
                            metadata_server)
                return ERR_METADATA
            key = protocol.strip().lower()
            if key not in _PROTOCOLS:
                log.warning("initialize: protocol %r is not supported (tcp, rdma, shm)",
                            protocol)
                return ERR_INVALID_ARGUMENT
            try:
                host, port = _split_hostport(local_hostname)
                bind = socket.getaddrinfo(host or "127.0.0.1", None)[0][4][0]
            except (OSError, ValueError) as exc:
                log.warning("initialize: cannot resolve %r: %s", local_hostname, exc)
                return ERR_DNS
            self._timeout = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
            name = f"mooncake-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                self._engine = Engine(name, host=str(bind), port=port,
                                      transports=_PROTOCOLS[key],
                                      timeout=min(self._timeout, 10.0))
            except NotSupportedError as exc:
                log.warning("initialize: %s", exc)
                return ERR_DEVICE_NOT_FOUND
            except ValueError as exc:  # an exposed address without a control secret
                log.warning("initialize: %s", exc)
                return ERR_INVALID_ARGUMENT
            except (TransferEngineError, OSError) as exc:
                log.warning("initialize: %s", exc)
                return ERR_SOCKET
            self._session_host = host
            if device_name:
                log.info("initialize: device_name %r is chosen by topology here", device_name)
            return 0

    def get_engine(self) -> Engine | None:
        """The engine underneath (ours, not Mooncake's inner engine)."""
        return self._engine

    def get_rpc_port(self) -> int:
        """The port peers name in ``target_hostname`` (``"host:port"``); -1 before
        :meth:`initialize`."""
        if self._engine is None:
            return ERR_INVALID_ARGUMENT
        return int(self._engine.endpoint.rsplit(":", 1)[1])

    def get_local_topology(self, device_name: str | None = None) -> str:
        """A JSON description of the transports this engine runs."""
        engine = self._engine
        if engine is None:
            return "{}"
        meta = engine.metadata()
        return json.dumps({"name": meta["name"], "endpoint": meta["control"],
                           "transports": sorted(meta["transports"])})

    # --- memory -----------------------------------------------------------------------

    def _need_engine(self) -> Engine:
        if self._engine is None or self._engine.closed:
            raise _Failed(ERR_INVALID_ARGUMENT, "engine not initialised (or closed)")
        return self._engine

    def _rebuild_local_map(self) -> None:
        self._local_map = _AddressMap([(s.address, s.address + s.length, s)
                                       for s in self._local.values()])

    def _register(self, address: int, length: int, owner: object = None) -> Segment:
        engine = self._need_engine()
        if not isinstance(address, int) or not isinstance(length, int) or address <= 0 \
                or length <= 0:
            raise _Failed(ERR_INVALID_ARGUMENT, f"bad region ({address!r}, {length!r})")
        with self._lock:
            if self._local_map.overlaps(address, length):
                raise _Failed(ERR_ADDRESS_OVERLAPPED,
                              f"{length} bytes at {address:#x} overlap a registered region")
            seg = engine.register(owner if owner is not None else (address, length),
                                  name=f"{_SEGMENT_PREFIX}{address:x}")
            self._local[address] = seg
            self._rebuild_local_map()
        return seg

    def _unregister(self, address: int) -> None:
        with self._lock:
            seg = self._local.get(address)
            if seg is None:
                raise _Failed(ERR_ADDRESS_NOT_REGISTERED, f"{address:#x} is not registered")
            seg.close()  # waits (bounded) for transfers using it
            del self._local[address]
            self._rebuild_local_map()

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` so that peers can read and
        write them by address. Returns 0, ``ERR_ADDRESS_OVERLAPPED`` if the range
        overlaps a registered one, or another negative code."""
        return self._call("register_memory", self._register, buffer_addr, capacity)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Revokes peer access to the region registered at ``buffer_addr``."""
        return self._call("unregister_memory", self._unregister, buffer_addr)

    def batch_register_memory(self, buffer_addresses: Sequence[int],
                              capacities: Sequence[int]) -> int:
        if len(buffer_addresses) != len(capacities):
            log.warning("batch_register_memory: %d addresses, %d capacities",
                        len(buffer_addresses), len(capacities))
            return ERR_INVALID_ARGUMENT
        for i, (addr, cap) in enumerate(zip(buffer_addresses, capacities, strict=True)):
            ret = self.register_memory(addr, cap)
            if ret != 0:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return ret
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        result = 0
        for addr in buffer_addresses:
            ret = self.unregister_memory(addr)
            result = result or ret
        return result

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes; returns their address, or 0."""
        try:
            if not isinstance(length, int) or length <= 0:
                raise _Failed(ERR_INVALID_ARGUMENT, f"bad length {length!r}")
            try:
                buf = np.zeros(length, dtype=np.uint8)
            except MemoryError as exc:
                raise _Failed(ERR_MEMORY, f"cannot allocate {length} bytes") from exc
            address = int(buf.ctypes.data)
            seg = self._register(address, length, owner=buf)
            with self._lock:
                self._managed[address] = (buf, seg)
            return address
        except (_Failed, TransferEngineError) as exc:
            log.warning("allocate_managed_buffer: %s", exc)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        def free() -> None:
            with self._lock:
                entry = self._managed.get(buffer_addr)
                if entry is None or entry[0].nbytes != length:
                    raise _Failed(ERR_INVALID_ARGUMENT,
                                  f"no managed buffer of {length} bytes at {buffer_addr:#x}")
                self._unregister(buffer_addr)
                del self._managed[buffer_addr]
        return self._call("free_managed_buffer", free)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src_ptr`` to ``dest_address`` (local memory)."""
        if length < 0 or length > len(src_ptr) or dest_address <= 0:
            return ERR_INVALID_ARGUMENT
        ctypes.memmove(dest_address, bytes(src_ptr[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        if length <= 0 or source_address <= 0:
            return b""
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first memory registered by the engine ``segment_name``
        (``"host:port"``; our own session id gives ours), or 0."""
        try:
            if segment_name in self._own_names():
                with self._lock:
                    first = self._local_map.first()
                return int(first.address) if first is not None else 0
            peer = self._peer(segment_name)
            peer.refresh()
            with self._lock:
                self._maps[segment_name] = _remote_map(peer)
                seg = self._maps[segment_name].first()
            return int(seg.name[len(_SEGMENT_PREFIX):], 16) if seg is not None else 0
        except (_Failed, TransferEngineError) as exc:
            log.warning("get_first_buffer_address(%s): %s", segment_name, exc)
            return 0

    def _own_names(self) -> set[str]:
        if self._engine is None:
            return set()
        port = self.get_rpc_port()
        return {f"{self._session_host}:{port}", f"{self._engine.host}:{port}"}

    # --- peers ------------------------------------------------------------------------

    def _peer(self, target_hostname: str) -> Peer:
        engine = self._need_engine()
        with self._lock:
            peer = self._peers.get(target_hostname)
            if peer is not None:
                return peer
        try:
            host, port = _split_hostport(target_hostname)
        except ValueError as exc:
            raise _Failed(ERR_INVALID_ARGUMENT, f"bad target {target_hostname!r}") from exc
        if not port:
            raise _Failed(ERR_INVALID_ARGUMENT,
                          f"target {target_hostname!r} needs the peer's rpc port (host:port)")
        address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        peer = engine.connect(address, timeout=min(self._timeout, 10.0))
        with self._lock:
            self._peers[target_hostname] = peer
            self._maps[target_hostname] = _remote_map(peer)
        return peer

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers a segment query, non-zero otherwise."""
        def probe() -> None:
            self._peer(peer_server_name).refresh()
        return self._call("send_probe", probe)

    # --- transfers --------------------------------------------------------------------

    def _pairs(self, target: str, buffers: Sequence[int], peer_addresses: Sequence[int],
               lengths: Sequence[int], temps: list[Segment]
               ) -> tuple[Peer, list[tuple[Descriptor, Descriptor]]]:
        if not (len(buffers) == len(peer_addresses) == len(lengths)) or not buffers:
            raise _Failed(ERR_INVALID_ARGUMENT,
                          f"{len(buffers)} buffers, {len(peer_addresses)} peer addresses, "
                          f"{len(lengths)} lengths")
        engine = self._need_engine()
        peer = self._peer(target)
        pairs = []
        refreshed = False
        for buf, remote, length in zip(buffers, peer_addresses, lengths, strict=True):
            if not isinstance(length, int) or length <= 0:
                raise _Failed(ERR_INVALID_ARGUMENT, f"bad length {length!r}")
            with self._lock:
                found = self._maps[target].find(remote, length)
            if found is None and not refreshed:
                peer.refresh()  # the peer may have registered it since we connected
                refreshed = True
                with self._lock:
                    self._maps[target] = _remote_map(peer)
                    found = self._maps[target].find(remote, length)
            if found is None:
                raise _Failed(ERR_ADDRESS_NOT_REGISTERED,
                              f"{length} bytes at {remote:#x} lie in no region "
                              f"{target} registered")
            rseg, roff = found
            with self._lock:
                local = self._local_map.find(buf, length)
            if local is None:
                seg = engine.register((buf, length), name=f"mc-tmp:{uuid.uuid4().hex}")
                temps.append(seg)
                local = (seg, 0)
            lseg, loff = local
            pairs.append((Descriptor(lseg, loff, length), Descriptor(rseg, roff, length)))
        return peer, pairs

    def _submit(self, target: str, buffers: Sequence[int], peer_addresses: Sequence[int],
                lengths: Sequence[int], opcode: TransferOpcode | int,
                notify: TransferNotify | None) -> int:
        """Starts one batch; returns its id (> 0). Raises ``_Failed``/engine errors."""
        engine = self._need_engine()
        op = TransferOpcode(int(opcode))
        batch = _Batch(None, time.monotonic() + self._timeout)
        try:
            peer, pairs = self._pairs(target, buffers, peer_addresses, lengths, batch.temps)
            payload = notify._encode() if notify is not None else None
            submit = engine.write if op is TransferOpcode.WRITE else engine.read
            batch.handle = submit(peer, pairs, notify=payload)
        except BaseException:
            self._release(batch)
            raise
        with self._lock:
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = batch
        return batch_id

    def _release(self, batch: _Batch) -> None:
        for seg in batch.temps:
            try:
                seg.close()
            except TransferEngineError as exc:  # still busy: the engine closes it later
                log.warning("temporary registration not released: %s", exc)
        batch.temps = []

    def _wait(self, batch_id: int) -> None:
        """Waits for a batch and forgets it; raises on failure."""
        with self._lock:
            batch = self._batches.pop(batch_id, None)
        if batch is None or batch.handle is None:
            raise _Failed(ERR_INVALID_ARGUMENT, f"unknown batch id {batch_id}")
        try:
            batch.handle.wait(max(0.0, batch.deadline - time.monotonic()))
        finally:
            if batch.handle.done():
                self._release(batch)
            else:  # timed out: release once it finishes (it still holds the pins)
                with self._lock:
                    self._batches[-batch_id] = batch

    def _sync(self, name: str, target: str, buffers: Sequence[int],
              peer_addresses: Sequence[int], lengths: Sequence[int],
              opcode: TransferOpcode | int, notify: TransferNotify | None = None) -> int:
        def run() -> None:
            self._wait(self._submit(target, buffers, peer_addresses, lengths, opcode, notify))
        ret = self._call(name, run)
        if ret != 0:
            with self._lock:  # stale addresses: ask the peer afresh next time
                if target in self._peers:
                    self._maps[target] = _AddressMap()
        return ret

    def _async(self, name: str, target: str, buffers: Sequence[int],
               peer_addresses: Sequence[int], lengths: Sequence[int],
               opcode: TransferOpcode | int, failure: int) -> int:
        try:
            return self._submit(target, buffers, peer_addresses, lengths, opcode, None)
        except (_Failed, TransferEngineError) as exc:
            log.warning("%s to %s: %s", name, target, exc)
            return failure

    def transfer_sync_write(self, target_hostname: str, buffer: int,
                            peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Writes ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` of the
        peer; returns 0 once they landed, or a negative code."""
        return self._sync("transfer_sync_write", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.WRITE)

    def transfer_sync_read(self, target_hostname: str, buffer: int,
                           peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Reads ``length`` bytes at the peer's ``peer_buffer_address`` into ``buffer``."""
        return self._sync("transfer_sync_read", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.READ)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode | int,
                      notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        return self._sync("transfer_sync", target_hostname, [buffer], [peer_buffer_address],
                          [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        return self._sync("batch_transfer_sync_write", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.WRITE)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int],
                                 lengths: Sequence[int], transport_hint: str = "") -> int:
        return self._sync("batch_transfer_sync_read", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.READ)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode | int,
                            notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        return self._sync("batch_transfer_sync", target_hostname, buffers,
                          peer_buffer_addresses, lengths, opcode, notify)

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Starts a write; returns a batch id for :meth:`transfer_check_status`, or a
        negative code."""
        return self._async("transfer_submit_write", target_hostname, [buffer],
                           [peer_buffer_address], [length], TransferOpcode.WRITE,
                           ERR_INVALID_ARGUMENT)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts a batch of writes; returns its batch id, or 0 on failure."""
        return self._async("batch_transfer_async_write", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.WRITE, 0)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        return self._async("batch_transfer_async_read", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.READ, 0)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode | int, transport_hint: str = "") -> int:
        return self._async("batch_transfer_async", target_hostname, buffers,
                           peer_buffer_addresses, lengths, opcode, 0)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed (or unknown id), -2 past ``MC_TRANSFER_TIMEOUT``.
        A batch is forgotten once a final status (1, -1, -2) was returned."""
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None or batch.handle is None:
            return STATUS_FAILED
        state = batch.handle.state
        if state is TransferState.PENDING:
            if time.monotonic() < batch.deadline:
                return STATUS_PENDING
            with self._lock:
                self._batches.pop(batch_id, None)
                self._batches[-batch_id] = batch  # released when it finishes
            log.warning("batch %d timed out after %.1fs", batch_id, self._timeout)
            return STATUS_TIMEOUT
        with self._lock:
            self._batches.pop(batch_id, None)
        self._release(batch)
        if state is TransferState.FAILED:
            log.warning("batch %d failed: %s", batch_id, batch.handle.error)
            return STATUS_FAILED
        return STATUS_COMPLETED

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch; 0 if all succeeded, -1 if any failed or timed out."""
        result = 0
        for batch_id in batch_ids:
            if self._call("get_batch_transfer_status", self._wait, batch_id) != 0:
                result = STATUS_FAILED
        self._reap()
        return result

    def _reap(self) -> None:
        """Releases timed-out batches that have finished since."""
        with self._lock:
            late = [(k, b) for k, b in self._batches.items()
                    if k < 0 and b.handle is not None and b.handle.done()]
            for k, _ in late:
                del self._batches[k]
        for _, batch in late:
            self._release(batch)

    def transfer_write_on_cuda(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("transfer_write_on_cuda: CUDA streams are not supported here")

    transfer_read_on_cuda = transfer_write_on_cuda
    batch_transfer_write_on_cuda = transfer_write_on_cuda
    batch_transfer_read_on_cuda = transfer_write_on_cuda

    # --- notifications ----------------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (each exactly once)."""
        engine = self._engine
        if engine is None:
            return []
        return [TransferNotify._decode(n.peer, n.payload) for n in engine.notifications(0)]

    # --- plumbing ---------------------------------------------------------------------

    def _call(self, name: str, fn: Any, *args: Any) -> int:
        try:
            fn(*args)
            return 0
        except (_Failed, TransferEngineError) as exc:
            log.warning("%s: %s", name, exc)
            return _code(exc)

    def close(self) -> None:
        """Closes the engine and frees managed buffers. Idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            batches = list(self._batches.values())
            self._batches.clear()
            self._peers.clear()
            self._maps.clear()
        if engine is not None:
            engine.close()  # fails in-flight transfers, then deregisters every segment
        for batch in batches:
            batch.temps = []
        with self._lock:
            self._local.clear()
            self._local_map = _AddressMap()
            self._managed.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is None:
            return
        try:
            warnings.warn("mooncake_compat.TransferEngine was not closed", ResourceWarning,
                          stacklevel=2)
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        engine = self._engine
        where = f"{self._session_host}:{self.get_rpc_port()}" if engine else "uninitialised"
        return (f"<mooncake_compat.TransferEngine {where} regions={len(self._local)} "
                f"peers={len(self._peers)} batches={len(self._batches)}>")
