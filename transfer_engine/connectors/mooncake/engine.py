"""Mooncake's ``mooncake.engine.TransferEngine`` on top of :class:`transfer_engine.Engine`.

Code written for Mooncake's Python engine runs on ours unchanged through the
``mooncake`` shim (``te-mooncake run script.py``, see docs/mooncake.md), or by changing
one import::

    from transfer_engine.connectors.mooncake import TransferEngine, TransferOpcode

Method names, arguments, return values and failure values are Mooncake's (the table in
docs/mooncake.md lists them): methods never raise, ``0`` is success, sync transfers fail
with ``-1``, async submissions fail with ``0`` (a batch id is never 0), a probe fails
with ``-101`` (name does not resolve), ``-102`` (refused) or ``-200`` (not in the
metadata service). This is the one place in the project where errors become integers;
each failure's reason is logged at WARNING level.

How Mooncake's ideas map onto ours:

- *Segment name* (``local_hostname``, ``target_hostname``): with ``P2PHANDSHAKE`` it is
  ``host:rpc_port`` (the port our engine chose: :meth:`get_rpc_port`); with an HTTP
  metadata server it is any name, published there with our control endpoint
  (:mod:`.metadata`). Peers are handshaken on first use and cached; an unknown or
  refused peer fails at once (a TCP probe precedes the handshake).
- *Raw peer addresses*: Mooncake names remote memory by the peer's virtual address; we
  name it by (segment, offset). Memory registered here gets a segment named
  ``mc:<hex base address>`` so that a peer maps an address to the segment holding it.
- *Local buffers* that were never registered are registered for one transfer (as
  Mooncake's TCP transport allows).
- *Protocol*: ``"tcp"`` (or ``$MC_FORCE_TCP``) uses TCP only; ``"rdma"`` and Mooncake's
  other fabrics (``efa``, ``cxi``, ...) use RDMA where a device exists and fall back to
  TCP with one warning where none does, as Mooncake; ``"shm"`` same-host shared memory
  then TCP; ``""``/``"auto"`` our default choice.
- *Timeouts*: ``$MC_TRANSFER_TIMEOUT`` (seconds, at least 5, default 30) plus one second
  per GB bounds each transfer, as Mooncake.
- *Notifications*: ``TransferNotify(name, msg)`` comes out of the peer's
  ``get_notifies()`` once every byte has landed (on every transport, TCP included).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from transfer_engine.control.auth import AuthConfig
from transfer_engine.descriptor import Descriptor
from transfer_engine.engine import Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

from .metadata import (
    P2PHANDSHAKE,
    Directory,
    DirectoryError,
    Location,
    open_directory,
    probe,
    split_hostport,
)

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_ADDRESS_OVERLAPPED",
           "ERR_DNS", "ERR_SOCKET", "ERR_METADATA", "SUPPORT_CUDA"]

log = logging.getLogger(__name__)

# Mooncake's error.h codes that its Python API returns.
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_METADATA = -200

# transfer_check_status results
STATUS_COMPLETED = 1
STATUS_PENDING = 0
STATUS_FAILED = -1
STATUS_TIMEOUT = -2

SUPPORT_CUDA = False  # the *_on_cuda calls are absent, as in Mooncake's non-CUDA build

_SEGMENT_PREFIX = "mc:"  # mc:<hex base address>: how a peer maps raw addresses
_NOTIFY_MAGIC = b"\x00mcn1"  # notification payloads made by TransferNotify
_PROBE_TIMEOUT = 3.0  # seconds for the TCP probe before a first handshake
_FABRICS = ("rdma", "efa", "cxi", "ub", "ubshmem", "barex", "ascend")


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode`` (``Read``/``Write``; ``READ``/``WRITE`` too)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


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


@dataclass(eq=False)
class _Batch:
    """One submitted batch: its handle (None: nothing to move), temporary segments, and
    deadline."""

    handle: TransferHandle | None
    deadline: float
    temps: list[Segment] = field(default_factory=list)


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
        """The segment registered first."""
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


def _transports(protocol: str) -> tuple[str, ...] | None:
    """Our transports for a Mooncake protocol name."""
    if os.environ.get("MC_FORCE_TCP"):
        return ("tcp",)
    key = protocol.strip().lower()
    if key == "tcp":
        return ("tcp",)
    if key in _FABRICS:
        return ("rdma", "tcp")
    if key == "shm":
        return ("shm", "tcp")
    if key not in ("", "auto"):
        log.warning("initialize: protocol %r is not available here; choosing among "
                    "shm, rdma and tcp as for \"auto\"", protocol)
    return None


def _timeout() -> float:
    """``$MC_TRANSFER_TIMEOUT`` as Mooncake reads it: whole seconds, at least 5."""
    try:
        return float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
    except ValueError:
        return 30.0


class TransferEngine:
    """Mooncake's ``mooncake.engine.TransferEngine`` API over our :class:`Engine`.

    Construct, then :meth:`initialize`; calls before that fail with their failure value.
    :meth:`close` (or a ``with`` block) releases the engine and withdraws its name from
    the metadata server; Mooncake code never closes, so garbage collection does it too.
    """

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._directory: Directory | None = None
        self._name = ""  # our segment name
        self._lock = threading.RLock()
        self._local: dict[int, Segment] = {}  # base address -> registered segment
        self._local_map = _AddressMap()
        self._managed: dict[int, tuple[np.ndarray, int]] = {}  # addr -> (memory, length)
        self._peers: dict[str, Peer] = {}
        self._maps: dict[str, _AddressMap] = {}
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._timeout = 30.0

    # --- initialisation ---------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Starts the engine. ``metadata_server``: ``"P2PHANDSHAKE"``, an
        ``http://host:port/metadata`` URL, ``etcd://host:port`` (or a bare
        ``host:port``, Mooncake's default) or ``redis://host:port``. Returns 0, or -1
        with the reason logged (at once for a metadata service nobody serves)."""
        scheme, sep, rest = metadata_server.partition("://")
        if sep:
            return self.initialize_ext(local_hostname, rest, protocol, device_name, scheme)
        if metadata_server == P2PHANDSHAKE:
            return self.initialize_ext(local_hostname, metadata_server, protocol,
                                       device_name, "")
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name,
                                   "etcd")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """:meth:`initialize` with the metadata type apart (``"http"``, ``"etcd"``,
        ``"redis"``; ``"p2p"`` or a ``"P2PHANDSHAKE"`` server for the handshake)."""
        with self._lock:
            if self._engine is not None:
                log.warning("initialize: already initialised")
                return -1
            if protocol.strip().lower() == "xgmi":
                log.warning("initialize: protocol 'xgmi' is not exposed in the Python API")
                return -1
            if metadata_server == P2PHANDSHAKE or metadata_type.lower() == "p2p":
                conn = P2PHANDSHAKE
            elif "://" in metadata_server:
                conn = metadata_server
            else:
                conn = f"{metadata_type or 'etcd'}://{metadata_server}"
            try:
                return self._start(local_hostname, conn, protocol)
            except _Failed as exc:
                log.warning("initialize: %s", exc)
                return -1

    def _start(self, local_hostname: str, conn: str, protocol: str) -> int:
        auth = AuthConfig.from_env()
        try:
            directory = open_directory(conn, auth.signer())
        except ValueError as exc:
            raise _Failed(-1, str(exc)) from None
        try:
            return self._start_with(directory, local_hostname, protocol, auth)
        except _Failed:
            directory.close()
            raise

    def _start_with(self, directory: Directory, local_hostname: str, protocol: str,
                    auth: AuthConfig) -> int:
        try:
            host, port = split_hostport(local_hostname)
        except ValueError as exc:
            raise _Failed(-1, f"bad local_hostname {local_hostname!r}: {exc}") from None
        bind = os.environ.get("MC_TCP_BIND_ADDRESS") or host or "127.0.0.1"
        try:
            bind = str(socket.getaddrinfo(bind, None)[0][4][0])
        except (OSError, UnicodeError):
            if directory.mode == "p2p":
                raise _Failed(-1, f"cannot resolve {bind!r}") from None
            bind = "127.0.0.1"  # a plain name in a metadata service: serve loopback
        try:
            directory.check()  # before starting an engine (and its serving processes)
        except DirectoryError as exc:
            raise _Failed(-1, str(exc)) from None
        transports = _transports(protocol)
        self._timeout = _timeout()
        engine_name = f"mooncake-{host or bind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # the port is ours to choose, as Mooncake's: peers learn it from the name
            # (P2P, via get_rpc_port) or from the metadata server
            # served from a serving process unless TE_SERVE says otherwise: Mooncake's
            # engine moves bytes on threads of its own, never waiting for the caller's
            # Python, and code written for it expects as much
            engine = Engine(engine_name, host=bind, port=0, transports=transports,
                            timeout=min(self._timeout, 10.0), auth=auth,
                            serve=os.environ.get("TE_SERVE") or "process")
        except (ValueError, TransferEngineError, OSError) as exc:
            raise _Failed(-1, str(exc)) from None
        if transports is not None and "rdma" in transports and "rdma" not in \
                engine.metadata()["transports"]:
            log.warning("initialize: no RDMA device here; protocol %r runs over TCP",
                        protocol)
        port = int(engine.endpoint.rsplit(":", 1)[1])
        wrapped = f"[{bind}]" if ":" in bind else bind
        name = f"{wrapped}:{port}" if directory.mode == "p2p" else local_hostname
        try:
            directory.publish(name, Location(bind, port))
        except DirectoryError as exc:
            engine.close()
            raise _Failed(-1, str(exc)) from None
        self._engine, self._directory, self._name = engine, directory, name
        return 0

    def get_engine(self) -> Engine | None:
        """The engine underneath (ours, not Mooncake's C++ engine)."""
        return self._engine

    def get_engine_ptr(self) -> int:
        """An opaque non-zero handle of the engine underneath (0 before
        :meth:`initialize`); Mooncake hands out its C++ pointer here."""
        return id(self._engine) if self._engine is not None else 0

    def get_rpc_port(self) -> int:
        """The port our handshake listens on; -1 before :meth:`initialize`."""
        if self._engine is None:
            return -1
        return int(self._engine.endpoint.rsplit(":", 1)[1])

    def get_local_topology(self, device_name: str | None = None) -> str:
        """Mooncake's topology JSON: ``{"cpu:<numa>": [[preferred NICs], [others]]}``."""
        nics: list[str] = []
        engine = self._engine
        if engine is not None:
            nics = [str(n.get("name", n)) if isinstance(n, dict) else str(n)
                    for n in engine.metadata().get("nics", [])]
        if device_name:
            wanted = set(device_name.split(","))
            nics = [n for n in nics if n in wanted]
        return json.dumps({"cpu:0": [nics, []]}, indent="\t")

    # --- memory -----------------------------------------------------------------------

    def _need_engine(self) -> Engine:
        if self._engine is None or self._engine.closed:
            raise _Failed(-1, "engine not initialised (or closed)")
        return self._engine

    def _rebuild_local_map(self) -> None:
        self._local_map = _AddressMap([(s.address, s.address + s.length, s)
                                       for s in self._local.values()])

    def _publish_buffers(self) -> None:
        directory = self._directory
        if directory is not None and directory.mode != "p2p":
            with self._lock:
                regions = [(s.address, s.length)
                           for s in sorted(self._local.values(), key=lambda s: s.id)]
            directory.publish_buffers(self._name, regions)

    def _register(self, address: int, length: int, owner: object = None) -> Segment:
        engine = self._need_engine()
        if not isinstance(address, int) or not isinstance(length, int) or address <= 0 \
                or length <= 0:
            raise _Failed(-1, f"bad region ({address!r}, {length!r})")
        with self._lock:
            if self._local_map.overlaps(address, length):
                raise _Failed(ERR_ADDRESS_OVERLAPPED,
                              f"{length} bytes at {address:#x} overlap a registered region")
            seg = engine.register(owner if owner is not None else (address, length),
                                  name=f"{_SEGMENT_PREFIX}{address:x}")
            self._local[address] = seg
            self._rebuild_local_map()
        self._publish_buffers()
        return seg

    def _unregister(self, address: int) -> None:
        with self._lock:
            seg = self._local.get(address)
            if seg is None:
                raise _Failed(ERR_ADDRESS_NOT_REGISTERED, f"{address:#x} is not registered")
            seg.close()  # waits (bounded) for transfers using it
            del self._local[address]
            self._rebuild_local_map()
        self._publish_buffers()

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` so that peers can read and
        write them by address. 0; -7 if the range overlaps a registered one; -1."""
        return self._call("register_memory", self._register, buffer_addr, capacity)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Revokes peer access to the region registered at ``buffer_addr``. 0; -3 if
        nothing is registered there."""
        return self._call("unregister_memory", self._unregister, buffer_addr)

    def batch_register_memory(self, buffer_addresses: Sequence[int],
                              capacities: Sequence[int], location: str = "*") -> int:
        """Registers every region or none. 0, or the first failure's code."""
        if len(buffer_addresses) != len(capacities):
            log.warning("batch_register_memory: %d addresses, %d capacities",
                        len(buffer_addresses), len(capacities))
            return -1
        for i, (addr, cap) in enumerate(zip(buffer_addresses, capacities, strict=True)):
            ret = self.register_memory(addr, cap)
            if ret != 0:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return ret
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters each region; 0, or the first failure's code (the rest are still
        unregistered)."""
        result = 0
        for addr in buffer_addresses:
            ret = self.unregister_memory(addr)
            result = result or ret
        return result

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes (at least one); returns their
        address, or 0."""
        try:
            if not isinstance(length, int) or length < 0:
                raise _Failed(-1, f"bad length {length!r}")
            try:
                buf = np.zeros(max(length, 1), dtype=np.uint8)
            except MemoryError as exc:
                raise _Failed(-1, f"cannot allocate {length} bytes") from exc
            address = int(buf.ctypes.data)
            self._register(address, buf.nbytes, owner=buf)
            with self._lock:
                self._managed[address] = (buf, length)
            return address
        except (_Failed, TransferEngineError) as exc:
            log.warning("allocate_managed_buffer: %s", exc)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer of :meth:`allocate_managed_buffer`. 0; -1 if none of that
        length is allocated at ``buffer_addr`` (Mooncake does not check)."""
        def free() -> None:
            with self._lock:
                entry = self._managed.get(buffer_addr)
                if entry is None or entry[1] != length:
                    raise _Failed(-1, f"no managed buffer of {length} bytes at "
                                      f"{buffer_addr:#x}")
                self._unregister(buffer_addr)
                del self._managed[buffer_addr]
        return self._call("free_managed_buffer", free)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src_ptr`` to ``dest_address`` (local memory)."""
        if length < 0 or length > len(src_ptr) or dest_address <= 0:
            return -1
        ctypes.memmove(dest_address, bytes(src_ptr[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes at ``source_address`` (local memory)."""
        if length <= 0 or source_address <= 0:
            return b""
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first memory registered by the engine ``segment_name``
        (our own name gives ours), or 0."""
        try:
            if segment_name == self._name:
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

    # --- peers ------------------------------------------------------------------------

    def _locate(self, target: str) -> Location:
        """Where ``target``'s handshake listens; fails at once when nobody does."""
        directory = self._directory
        if directory is None:
            raise _Failed(-1, "engine not initialised (or closed)")
        try:
            location = directory.lookup(target)
        except DirectoryError as exc:
            raise _Failed(exc.code, str(exc)) from None
        code = probe(location, min(_PROBE_TIMEOUT, self._timeout))
        if code == ERR_DNS:
            raise _Failed(code, f"{location.host!r} does not resolve")
        if code:
            raise _Failed(code, f"nobody listens at {location.host}:{location.port}")
        return location

    def _peer(self, target: str) -> Peer:
        engine = self._need_engine()
        with self._lock:
            peer = self._peers.get(target)
            if peer is not None and peer.lost is None:
                return peer
        location = self._locate(target)
        peer = engine.connect(location.endpoint, timeout=min(self._timeout, 10.0))
        with self._lock:
            if self._peers.get(target) is not peer:
                self._peers[target] = peer
                self._maps[target] = _remote_map(peer)
        return peer

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers; -101 its host does not resolve, -102 refused, -200
        not in the metadata server, -1 otherwise."""
        def run() -> None:
            self._need_engine()
            self._locate(peer_server_name)
            self._peer(peer_server_name).refresh()
        return self._call("send_probe", run)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Opens the connection to ``segment_name`` ahead of the first transfer. 0, or
        -1 when the peer cannot be reached (Mooncake builds without EFA always say 0)."""
        ret = self._call("warmup_efa_segment", self._peer, segment_name)
        return 0 if ret == 0 else -1

    # --- transfers --------------------------------------------------------------------

    def _pairs(self, target: str, buffers: Sequence[int], peer_addresses: Sequence[int],
               lengths: Sequence[int], temps: list[Segment]
               ) -> tuple[Peer, list[tuple[Descriptor, Descriptor]]]:
        engine = self._need_engine()
        peer = self._peer(target)  # first, as Mooncake opens the segment first
        if not (len(buffers) == len(peer_addresses) == len(lengths)):
            raise _Failed(-1, f"{len(buffers)} buffers, {len(peer_addresses)} peer "
                              f"addresses, {len(lengths)} lengths")
        pairs = []
        refreshed = False
        for buf, remote, length in zip(buffers, peer_addresses, lengths, strict=True):
            if not isinstance(length, int) or length < 0:
                raise _Failed(-1, f"bad length {length!r}")
            if length == 0:
                continue  # nothing to move, as Mooncake
            with self._lock:
                found = self._maps[target].find(remote, length)
            if found is None and not refreshed:
                peer.refresh()  # the peer may have registered it since we connected
                refreshed = True
                with self._lock:
                    self._maps[target] = _remote_map(peer)
                    found = self._maps[target].find(remote, length)
            if found is None:
                raise _Failed(-1, f"{length} bytes at {remote:#x} lie in no region "
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
        total = sum(n for n in lengths if isinstance(n, int) and n > 0)
        batch = _Batch(None, time.monotonic() + self._timeout + total / 1e9)
        try:
            peer, pairs = self._pairs(target, buffers, peer_addresses, lengths, batch.temps)
            if pairs:
                payload = notify._encode() if notify is not None else None
                submit = engine.write if op is TransferOpcode.Write else engine.read
                batch.handle = submit(peer, pairs, notify=payload)
        except BaseException:
            self._release(batch)
            with self._lock:  # stale addresses: ask the peer afresh next time
                if target in self._peers:
                    self._maps[target] = _AddressMap()
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
        if batch is None:
            raise _Failed(-1, f"unknown batch id {batch_id}")
        if batch.handle is None:
            return
        try:
            batch.handle.wait(max(0.0, batch.deadline - time.monotonic()))
        finally:
            if batch.handle.done():
                self._release(batch)
            else:  # timed out: cancel, release once it finishes (it holds the pins)
                batch.handle.cancel()
                with self._lock:
                    self._batches[-batch_id] = batch

    def _sync(self, name: str, target: str, buffers: Sequence[int],
              peer_addresses: Sequence[int], lengths: Sequence[int],
              opcode: TransferOpcode | int, notify: TransferNotify | None = None) -> int:
        def run() -> None:
            self._wait(self._submit(target, buffers, peer_addresses, lengths, opcode, notify))
        return 0 if self._call(name, run) == 0 else -1

    def _async(self, name: str, target: str, buffers: Sequence[int],
               peer_addresses: Sequence[int], lengths: Sequence[int],
               opcode: TransferOpcode | int) -> int:
        try:
            return self._submit(target, buffers, peer_addresses, lengths, opcode, None)
        except (_Failed, TransferEngineError) as exc:
            log.warning("%s to %s: %s", name, target, exc)
            return 0

    def transfer_sync_write(self, target_hostname: str, buffer: int,
                            peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Writes ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` of the
        peer; 0 once they landed, -1 on failure."""
        return self._sync("transfer_sync_write", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.Write)

    def transfer_sync_read(self, target_hostname: str, buffer: int,
                           peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Reads ``length`` bytes at the peer's ``peer_buffer_address`` into ``buffer``;
        0 or -1."""
        return self._sync("transfer_sync_read", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.Read)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode | int,
                      notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        """One transfer of either direction, with an optional notification; 0 or -1."""
        return self._sync("transfer_sync", target_hostname, [buffer], [peer_buffer_address],
                          [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        """Writes every (buffer, peer address, length) as one transfer; 0 or -1."""
        return self._sync("batch_transfer_sync_write", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Write)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int],
                                 lengths: Sequence[int], transport_hint: str = "") -> int:
        """Reads every (buffer, peer address, length) as one transfer; 0 or -1."""
        return self._sync("batch_transfer_sync_read", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Read)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode | int,
                            notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        """A batch of either direction, with an optional notification; 0 or -1."""
        return self._sync("batch_transfer_sync", target_hostname, buffers,
                          peer_buffer_addresses, lengths, opcode, notify)

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Starts a write; a batch id for :meth:`transfer_check_status`, or 0."""
        return self._async("transfer_submit_write", target_hostname, [buffer],
                           [peer_buffer_address], [length], TransferOpcode.Write)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts a batch of writes; its batch id, or 0."""
        return self._async("batch_transfer_async_write", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.Write)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts a batch of reads; its batch id, or 0."""
        return self._async("batch_transfer_async_read", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.Read)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode | int, transport_hint: str = "") -> int:
        """Starts a batch of either direction; its batch id, or 0."""
        return self._async("batch_transfer_async", target_hostname, buffers,
                           peer_buffer_addresses, lengths, opcode)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed (or unknown id), -2 past the deadline. A
        batch is forgotten once a final status (1, -1, -2) was returned."""
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None:
            return STATUS_FAILED
        state = TransferState.DONE if batch.handle is None else batch.handle.state
        if state is TransferState.PENDING:
            if time.monotonic() < batch.deadline:
                return STATUS_PENDING
            with self._lock:
                self._batches.pop(batch_id, None)
                self._batches[-batch_id] = batch  # released when it finishes
            assert batch.handle is not None
            batch.handle.cancel()
            log.warning("batch %d timed out after %.1fs", batch_id, self._timeout)
            return STATUS_TIMEOUT
        with self._lock:
            self._batches.pop(batch_id, None)
        self._release(batch)
        if state is TransferState.FAILED:
            assert batch.handle is not None
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

    # --- notifications ----------------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (each exactly once)."""
        engine = self._engine
        if engine is None:
            return []
        return [TransferNotify._decode(n.peer, n.payload) for n in engine.notifications(0)]

    # --- plumbing ---------------------------------------------------------------------

    def _call(self, name: str, fn: Callable[..., object], *args: Any) -> int:
        try:
            fn(*args)
            return 0
        except (_Failed, TransferEngineError) as exc:
            log.warning("%s: %s", name, exc)
            return exc.code if isinstance(exc, _Failed) else -1

    def close(self) -> None:
        """Closes the engine, frees managed buffers and withdraws our name from the
        metadata server. Idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            directory, self._directory = self._directory, None
            batches = list(self._batches.values())
            self._batches.clear()
            self._peers.clear()
            self._maps.clear()
        if directory is not None:
            directory.withdraw(self._name)
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
            warnings.warn("mooncake TransferEngine was not closed", ResourceWarning,
                          stacklevel=2)
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        where = self._name if self._engine is not None else "uninitialised"
        mode = self._directory.mode if self._directory is not None else "-"
        return (f"<mooncake TransferEngine {where} metadata={mode} "
                f"regions={len(self._local)} peers={len(self._peers)} "
                f"batches={len(self._batches)}>")


setattr(TransferEngine, "TransferOpcode", TransferOpcode)  # noqa: B010 (as Mooncake's class)
