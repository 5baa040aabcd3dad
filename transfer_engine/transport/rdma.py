"""RDMA transport over pyverbs: RC queue pairs, one rail per NIC pair, write-with-imm.

Two providers sit under the same rail code: pyverbs on a real NIC (``rdma_verbs``) and,
on machines without one, the emulated verbs provider (``provider="emulated"`` or
``TE_RDMA_PROVIDER=emulated``: ``rdma_emulated`` and ``rdma_emulated_device``), which
enforces verbs semantics and moves bytes between processes. A work's verbs requests
are built as columns (``rdma_batch``) and posted as one chain.

pyverbs (rdma-core's Python bindings, a distribution package) is imported when the
transport is built, never by ``import transfer_engine``. Without pyverbs, without a
device or without an active port the constructor raises ``NotSupportedError`` saying
which, and the engine falls back to tcp. Pure logic (immediates, work-request building,
error mapping, QP info) lives in ``rdma_plan`` and is tested without hardware.
Everything that touches pyverbs objects directly (``Device``, ``open_devices``, error
translation, QP attributes, chained work requests and their release) lives in
``rdma_verbs``.

Connection protocol (the handshake carries only what ``start`` returns)::

    start() -> {"devices": [names], "endpoint": "tcp://host:port"}

``connect(peer, info, ...)`` is one-sided, but an RC queue pair needs the other side's
QP number, so each transport owns a small TCP side channel at ``endpoint``. Frames are a
4-byte little-endian length and a msgpack map with ``"v": 1``:

    target    -> {"challenge": magic and nonce}                       (on accept)
    initiator -> {"kind": "connect", "rail": index, "device": the target NIC wanted,
                  "ticket", "nonce", "proof": the rail ticket's answer, "qp": our QpInfo}
    target    -> {"qp": its fresh QP's QpInfo, "proof": the target's answer,
                  "segments": {id: [base, length, rkey]}}
    initiator -> {"kind": "segments", "ids": [...]}   (a segment registered later)
    target    -> {"segments": {...}}                    or {"error": code, "message"}

No rkey and no QP leave the target before the initiator proved a ticket from the
engines' handshake (:mod:`~transfer_engine.control.tickets`); the target takes the
peer's name from the ticket, and refuses anything else with a bare "rail refused".
The side connection stays open for the life of the rail: when it closes, the target
destroys that QP, so a dead initiator leaks nothing. Rail ``k`` to a peer uses local NIC
``k % n_local`` and remote NIC ``k % n_remote`` (``rdma_plan.stripe_pairs``); ask for
``rails_per_nic * n_nics`` rails to get several QPs per NIC pair.

Data path: a work becomes RDMA WRITE (or READ) requests of at most ``max_sge`` entries
and ``max_msg_sz`` bytes; only the last is signaled. Work with an immediate ends in
RDMA_WRITE_WITH_IMM (``rdma_plan.encode_imm``), which consumes a receive at the target;
its completion feeds ``host.deliver_immediate`` exactly as the stream transports do.
Notification bytes do not fit in 32 bits, so work whose immediate carries ``notify``
ends instead in a plain WRITE then a SEND_WITH_IMM whose payload is a
``rdma_plan.NOTIFY_HEADER`` (full 64-bit id, expected, origin rail) and the bytes; RC
ordering makes the SEND land after the WRITE. Notify payloads are bounded by
``max_notify``.

Failure: the first error completion moves a QP to the error state and flushes the
rest. Errors that blame the path (retry exceeded, flush, fatal) hand the rail's
unfinished work, in order, to a healthy sibling rail to the same peer; there every
immediate travels as a SEND with header naming the failed rail, and the target counts
each (transfer, origin rail) once, so an immediate whose ack was lost is not counted
twice. Errors that blame the request (remote access: a deregistered segment) fail that
work only. When no sibling is left the work fails with ``PeerLostError``, and
``info("peer_failures")`` tells the engine to demote the peer to tcp.

Completions are read by one thread per NIC that sleeps on the completion channel's file
descriptor (``select.poll`` with a timeout, GIL released) rather than spinning;
pyverbs' own ``get_cq_event`` holds the GIL while it blocks, so it is only called once
the descriptor is readable.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgpack

from transfer_engine import topology
from transfer_engine.control.tickets import (
    CHALLENGE_MAGIC,
    Credential,
    Ticket,
    new_challenge,
)
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferError,
    TransferTimeout,
    error_code,
    error_from_wire,
)
from transfer_engine.segment import Segment
from transfer_engine.transport.base import (
    Capabilities,
    Completion,
    Host,
    Immediate,
    OnComplete,
    Rail,
    Transport,
    Work,
)
from transfer_engine.transport.rdma_batch import WrBatch, build_wr_batch, empty_batch
from transfer_engine.transport.rdma_plan import (
    NOTIFY_HEADER,
    ImmUnwrapper,
    MrKey,
    Opcode,
    QpInfo,
    Sge,
    WcOpcode,
    WrSpec,
    decode_imm,
    encode_imm,
    negotiate_mtu,
    pack_notify,
    random_psn,
    stripe_pairs,
    unpack_notify,
    wc_error,
    wc_retryable,
)
from transfer_engine.transport.rdma_verbs import Device
from transfer_engine.transport.stream import HELLO_TIMEOUT

__all__ = ["RdmaTransport", "RdmaRail"]

log = logging.getLogger(__name__)

WIRE_VERSION = 1
_FRAME = struct.Struct("<I")
_MAX_FRAME = 16 << 20
_RECV_BIT = 1 << 63
_SEEN_MAX = 1 << 16  # (transfer, origin rail) pairs remembered for de-duplication
_MAX_SIDE = 4096  # side channels served at once
_MAX_OPENING_FRAME = 16 << 10  # a connect message before its ticket is proven
PROVIDERS = ("pyverbs", "emulated")
WORK_PIECES = 256  # pieces per engine work: at most this many verbs requests (< sq_depth)


def _send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = msgpack.packb({"v": WIRE_VERSION, **msg})
    sock.sendall(_FRAME.pack(len(data)) + data)


class _SideRefused(Exception):
    """A side channel that did not open: answered with a bare refusal."""


def _recv_frame(sock: socket.socket, peer: str | None, limit: int = 0) -> dict[str, Any]:
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise PeerLostError("side channel closed", peer=peer, transport="rdma")
            buf += chunk
        return bytes(buf)
    (size,) = _FRAME.unpack(exact(_FRAME.size))
    if size > (limit or _MAX_FRAME):
        raise ProtocolError(f"side-channel frame of {size} bytes", peer=peer,
                            transport="rdma")
    try:
        msg = msgpack.unpackb(exact(size), strict_map_key=False)  # segment ids are ints
    except ValueError as exc:
        raise ProtocolError(f"malformed side-channel frame: {exc}", peer=peer,
                            transport="rdma") from exc
    if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION:
        raise ProtocolError(f"side-channel message of unknown version: {msg!r:.80}",
                            peer=peer, transport="rdma")
    if "error" in msg:
        raise error_from_wire(int(msg["error"]), str(msg.get("message", "")), peer=peer,
                              transport="rdma")
    return msg


def _keys_from_wire(data: Any) -> dict[int, MrKey]:
    return {int(k): MrKey(int(v[0]), int(v[1]), int(v[2])) for k, v in data.items()}


def _segment_ids(spans: Any) -> set[int]:
    """The segment ids of a work's pieces, without a Python object per piece when the
    planner handed them over as columns (``planner.Spans``)."""
    uniform = getattr(spans, "uniform", None)
    if uniform is not None:
        return {int(uniform[0])}
    seg = getattr(spans, "segment", None)
    if seg is not None and hasattr(seg, "tolist"):
        if len(seg) and bool((seg == seg[0]).all()):
            return {int(seg[0])}
        return set(seg.tolist())
    return {int(e[0]) for e in spans}


class _Inbound:
    """Target side of one rail: a QP that only receives, and its receive buffers."""

    def __init__(self, device: Device, peer: str, rail: int, depth: int, slot: int) -> None:
        self.device, self.peer, self.rail = device, peer, rail
        self.origin = b""  # the rail ticket's id: immediates count per connection
        self.qp = device.create_qp(send_wr=1, recv_wr=depth, send_sge=1)
        self.slot = slot
        self._lock = threading.Lock()  # a poller re-posting vs. a side thread closing
        self._closed = False
        try:
            self.mr = device.alloc_mr(depth * slot)
        except BaseException:
            device.destroy_qp(self.qp)
            raise
        self.key = device.qp_key(self.qp)
        try:
            for i in range(depth):
                self.post_recv(i)
        except BaseException:
            self.close()
            raise

    def post_recv(self, index: int) -> None:
        """(Re)posts receive slot ``index``; a no-op once closed (pyverbs would hand a
        destroyed QP's NULL pointer to ``ibv_post_recv``)."""
        with self._lock:
            if not self._closed:
                self.device.post_recv(self.qp, _RECV_BIT | (self.key << 20) | index,
                                      self.mr.buf + index * self.slot, self.slot,
                                      self.mr.lkey, peer=self.peer)

    def payload(self, index: int, nbytes: int) -> bytes:
        return bytes(self.mr.read(nbytes, index * self.slot))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.device.destroy_qp(self.qp)
        self.mr.close()


class RdmaRail(Rail):
    """One RC queue pair from one of our NICs to one of the peer's."""

    __slots__ = ("peer", "index", "device", "remote_device", "_transport", "_qp", "_sock",
                 "_on_complete", "_lock", "_state", "_backlog", "_inflight", "_free_wr",
                 "_remote_keys", "_notify_mr", "_notify_free", "_max_sge", "_max_msg",
                 "weight")

    def __init__(self, transport: RdmaTransport, peer: str, index: int, device: Device,
                 remote_device: str, qp: Any, sock: socket.socket,
                 remote_keys: dict[int, MrKey], on_complete: OnComplete) -> None:
        self.peer, self.index, self.device = peer, index, device
        self.remote_device = remote_device
        self.weight = device.link_rate_gbps or 1.0  # for the planner's striping weights
        self._transport, self._qp, self._sock = transport, qp, sock
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._state = "OPEN"
        self._backlog: collections.deque[tuple[Work, int]] = collections.deque()
        # wr_id -> (work, work requests, notify slot, origin rail of its immediate)
        self._inflight: dict[int, tuple[Work, int, int | None, int]] = {}
        self._free_wr = transport.sq_depth
        self._remote_keys = remote_keys
        slot = NOTIFY_HEADER.size + transport.max_notify
        self._notify_mr = device.alloc_mr(transport.notify_slots * slot)
        self._notify_free = list(range(transport.notify_slots))
        self._max_sge = device.max_sge
        self._max_msg = device.max_msg_size

    @property
    def closed(self) -> bool:
        return self._state != "OPEN"

    @property
    def inflight(self) -> int:
        return len(self._inflight) + len(self._backlog)

    def learn_segments(self, keys: dict[int, dict[str, Any]]) -> None:
        """Takes remote keys the engine already has (``RemoteSegment.keys["rdma"]``),
        saving the side-channel round trip a first use of a segment costs otherwise."""
        for seg_id, entry in keys.items():
            mr = entry.get("mrs", {}).get(self.remote_device)
            if mr is not None:
                self._remote_keys[int(seg_id)] = MrKey(int(mr[0]), int(mr[1]), int(mr[2]))

    def post(self, work: Work) -> None:
        if self._state == "CLOSED":
            raise ClosedError("rail is closed", peer=self.peer, transport="rdma")
        if self._state == "FAILED":
            raise PeerLostError("rail failed", peer=self.peer, transport="rdma")
        missing = [sid for sid in _segment_ids(work.remote) if sid not in self._remote_keys]
        if missing:  # one round trip per segment, then cached; bounded by the timeout
            self._fetch_keys(sorted(missing))
        with self._lock:  # the state again: the rail may have failed since the check
            if self._state != "OPEN":
                cls = ClosedError if self._state == "CLOSED" else PeerLostError
                raise cls(f"rail {self._state.lower()}", peer=self.peer, transport="rdma")
            self._backlog.append((work, self.index))
            self._pump()

    def _fetch_keys(self, ids: list[int]) -> None:
        with self._transport.side_lock(self):
            try:
                _send_frame(self._sock, {"kind": "segments", "ids": ids,
                                         "device": self.remote_device})
                reply = _recv_frame(self._sock, self.peer)
            except TimeoutError as exc:
                raise TransferTimeout("segment key lookup timed out", peer=self.peer,
                                      op="connect", transport="rdma") from exc
            except OSError as exc:
                raise PeerLostError(f"side channel failed: {exc}", peer=self.peer,
                                    transport="rdma") from exc
        self._remote_keys.update(_keys_from_wire(reply.get("segments", {})))

    def adopt(self, items: list[tuple[Work, int]], err: TransferError) -> None:
        """Takes over a failed sibling's unfinished work, in order (poller thread). A
        rail that failed meanwhile passes it on (or fails it) rather than keep it."""
        with self._lock:
            if self._state == "OPEN":
                self._backlog.extend(items)
                self._pump()
                return
        self._hand_over(items, err)

    def _specs(self, work: Work, origin: int) -> tuple[WrBatch, int | None]:
        imm = work.imm
        via_send = imm is not None and (imm.notify is not None or origin != self.index
                                        or work.op is Op.READ)
        direct = encode_imm(imm.transfer_id, imm.expected) if imm and not via_send else None
        max_sge = self._max_sge if work.op is Op.WRITE else self.device.max_sge_rd
        if work.nbytes == 0 and imm is not None and not work.local and not work.remote:
            specs = empty_batch()  # a notification alone (after a READ): the SEND only
            via_send = True
        else:
            specs = build_wr_batch(
                work.op, work.local, work.remote, local_keys=self._transport.local_keys(
                    self.device.name), remote_keys=self._remote_keys, max_sge=max_sge,
                max_msg_size=self._max_msg, imm=direct, peer=self.peer)
        if not via_send:
            return specs, None
        assert imm is not None
        notify = imm.notify or b""
        if len(notify) > self._transport.max_notify or not self._notify_free:
            if len(notify) > self._transport.max_notify:
                raise ProtocolError(f"notification of {len(notify)} bytes exceeds "
                                    f"max_notify={self._transport.max_notify}",
                                    peer=self.peer, transport="rdma")
            raise BlockingIOError  # no free notify slot yet: stay in the backlog
        slot = self._notify_free.pop()
        size = NOTIFY_HEADER.size + self._transport.max_notify
        data = pack_notify(imm.transfer_id, imm.expected, origin, imm.notify)
        self._notify_mr.write(data, len(data), slot * size)
        specs.unsignal_last()
        sge = Sge(self._notify_mr.buf + slot * size, len(data), self._notify_mr.lkey)
        send = WrSpec(Opcode.SEND_WITH_IMM, (sge,), 0, 0, True,
                      encode_imm(imm.transfer_id, imm.expected))
        return specs.append(send), slot

    def _pump(self) -> None:
        """Posts backlog work while the send queue has room (caller holds the lock)."""
        while self._backlog and self._state == "OPEN":
            work, origin = self._backlog[0]
            try:
                specs, slot = self._specs(work, origin)
            except BlockingIOError:
                return
            except TransferError as exc:
                self._backlog.popleft()
                self._transport.defer(self.device, self._on_complete,
                                      Completion(work, exc.with_context(peer=self.peer)))
                continue
            if len(specs) > self._transport.sq_depth:
                self._backlog.popleft()
                err = ProtocolError(f"work needs {len(specs)} work requests; the send "
                                    f"queue holds {self._transport.sq_depth}",
                                    peer=self.peer, transport="rdma", op=str(work.op))
                self._transport.defer(self.device, self._on_complete, Completion(work, err))
                continue
            if len(specs) > self._free_wr:
                if slot is not None:
                    self._notify_free.append(slot)
                return
            self._backlog.popleft()
            wr_id = self._transport.new_wr_id(self)
            self._inflight[wr_id] = (work, len(specs), slot, origin)
            self._free_wr -= len(specs)
            try:  # the SEND's entry points at its notify slot (see _specs)
                self.device.post_send(self._qp, wr_id, specs, self.peer)
            except ProtocolError as exc:  # this work's values, not the rail: fail it
                self._inflight.pop(wr_id, None)
                self._free_wr += len(specs)
                self._transport.forget_wr_ids([wr_id])
                if slot is not None:
                    self._notify_free.append(slot)
                self._transport.defer(self.device, self._on_complete, Completion(
                    work, exc.with_context(peer=self.peer, op=str(work.op))))
                continue
            except TransferError as exc:
                self._inflight.pop(wr_id, None)
                self._free_wr += len(specs)
                self._transport.forget_wr_ids([wr_id])
                self._transport.defer(self.device, self._fail_from, wr_id, exc, work, True,
                                      origin)
                return

    def on_wc(self, wr_id: int, status: int, vendor_err: int) -> None:
        """A send completion for this rail (poller thread)."""
        with self._lock:
            entry = self._inflight.pop(wr_id, None)
            if entry is None:
                return  # flushed after a failure already handled
            work, count, slot, origin = entry
            self._free_wr += count
            if slot is not None:
                self._notify_free.append(slot)
            if status == 0:
                self._pump()
        if status == 0:
            self._on_complete(Completion(work))
            return
        err = wc_error(status, vendor_err, closing=self._state == "CLOSED", peer=self.peer,
                       op=str(work.op), transport="rdma")
        self._fail_from(wr_id, err, work, retry=wc_retryable(status), origin=origin)

    def _fail_from(self, wr_id: int, err: TransferError, culprit: Work | None,
                   retry: bool = True, origin: int | None = None) -> None:
        """The QP is unusable: hand unfinished work to a sibling or fail it.
        ``origin``: the rail the culprit's immediate stands for (this one's if None)."""
        origin = self.index if origin is None else origin
        with self._lock:
            if self._state == "OPEN":
                self._state = "FAILED"
            # in posting order, each with the rail its immediate stands for (adopted
            # work keeps its first rail's, so the target counts it once)
            rest = [(w, origin) for _, (w, _, _, origin) in sorted(self._inflight.items())]
            rest += list(self._backlog)
            self._transport.forget_wr_ids(list(self._inflight))
            self._inflight.clear()
            self._backlog.clear()
        self._transport.note_failure(self.peer)
        items = ([(culprit, origin)] if retry and culprit is not None else []) + rest
        if not retry and culprit is not None:
            self._on_complete(Completion(culprit, err))
        self._hand_over(items, err, culprit)

    def _hand_over(self, items: list[tuple[Work, int]], err: TransferError,
                   culprit: Work | None = None) -> None:
        """Moves a failed rail's work to a sibling, or fails it when none is left."""
        if not items:
            return
        sibling = self._transport.sibling(self)
        if sibling is not None and self._state != "CLOSED":
            log.warning("rdma rail %s#%d failed (%s); %d works move to rail #%d",
                        self.peer, self.index, err, len(items), sibling.index)
            sibling.adopt(items, err)
            return
        for work, _ in items:
            self._on_complete(Completion(work, err if work is culprit else PeerLostError(
                "rail failed and no other rdma rail reaches the peer", peer=self.peer,
                op=str(work.op), transport="rdma")))

    def fail(self, err: TransferError) -> None:
        """The path is gone (a lost NIC): unfinished work moves to a sibling rail."""
        self._fail_from(0, err, None)

    def close(self) -> None:
        self.abort(None)

    def abort(self, error: TransferError | None) -> None:
        with self._lock:
            if self._state == "CLOSED":
                return
            self._state = "CLOSED"
            pending = [w for w, _, _, _ in self._inflight.values()]
            pending += [w for w, _ in self._backlog]
            self._transport.forget_wr_ids(list(self._inflight))
            self._inflight.clear()
            self._backlog.clear()
        for work in pending:
            self._on_complete(Completion(work, error or ClosedError(
                "rail closed", peer=self.peer, op=str(work.op), transport="rdma")))
        self._transport.forget_rail(self)
        self._sock.close()
        self.device.destroy_qp(self._qp)
        self._notify_mr.close()

    def __repr__(self) -> str:
        return (f"<Rail rdma→{self.peer}#{self.index} {self.device.name}→"
                f"{self.remote_device} {self._state} inflight={self.inflight}>")


class RdmaTransport(Transport):
    """RDMA rails over RC queue pairs (pyverbs).

    :param devices: NIC names (``"mlx5_0,mlx5_1"`` or a list); None takes every device
        with an active port.
    :param rails_per_nic: queue pairs per NIC pair that ``default_rails`` asks for.
    :param host: address the side channel listens on (the engine passes its own, so
        without a control secret it is loopback unless opted in); ``advertise``: the
        address peers dial (default: ``host``, or this host's name for a wildcard).
    :param port: side-channel port; 0 picks a free one.
    :param gid_index: GID table index (RoCE needs the right one); None picks one.
    :param slice_size: bytes per work request the planner aims for.
    :param max_notify: largest notification payload in bytes.
    :param sq_depth / recv_depth: send / receive queue entries per QP.
    :param cq_depth: completion queue entries per NIC (capped by the device). Every QP
        reserves its queues' worth (``sq_depth + 1`` for a rail, ``recv_depth + 1``
        for a peer's rail to us), so a rail that would let it overrun is refused.
    :param relaxed_ordering: register memory with relaxed PCIe ordering when supported.
    :param provider: ``"pyverbs"`` (a real NIC) or ``"emulated"`` (the user-space
        provider of ``rdma_emulated``, for machines without one); None reads
        ``$TE_RDMA_PROVIDER``, default ``"pyverbs"``. Peers only pair with the same
        provider, and emulated ones only on the same host.
    :param emulated_copy: with the emulated provider, whether bytes really move (False:
        a counting device that checks and completes everything and copies nothing).
    """

    name = "rdma"

    def __init__(self, devices: str | list[str] | None = None, rails_per_nic: int = 2,
                 host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 gid_index: int | None = None, slice_size: int = 4 << 20,
                 max_notify: int = 4096, sq_depth: int = 1024, recv_depth: int = 256,
                 notify_slots: int = 64, relaxed_ordering: bool = True,
                 poll_interval: float = 0.2, provider: str | None = None,
                 emulated_copy: bool = True, cq_depth: int = 1 << 16) -> None:
        provider = provider or os.environ.get("TE_RDMA_PROVIDER") or "pyverbs"
        if provider not in PROVIDERS:
            raise NotSupportedError(f"unknown RDMA provider {provider!r}; known: "
                                    f"{list(PROVIDERS)}", transport="rdma")
        self.provider = provider
        names = devices.split(",") if isinstance(devices, str) else devices
        kwargs: dict[str, Any] = {"gid_index": gid_index, "cq_depth": cq_depth,
                                  "relaxed_ordering": relaxed_ordering,
                                  "on_wc": self._on_wc, "poll_interval": poll_interval}
        if provider == "emulated":
            from transfer_engine.transport import rdma_emulated_device as emu  # noqa: PLC0415

            kwargs.update(copy=emulated_copy, on_event=self._on_device_event)
            self._devices: list[Any] = list(emu.open_devices(names, **kwargs))
        else:
            from transfer_engine.transport import rdma_verbs  # noqa: PLC0415

            rdma_verbs.import_pyverbs()  # NotSupportedError with the reason and remedy
            self._devices = list(rdma_verbs.open_devices(names, **kwargs))
        self._by_name = {d.name: d for d in self._devices}
        nics = topology.discover().nics  # link rates for the striping weights
        for dev in self._devices:
            nic = next((n for n in nics if n.name == dev.name), None)
            dev.link_rate_gbps = nic.link_rate_gbps if nic else 0.0
        self._side_socks: set[socket.socket] = set()
        self.rails_per_nic, self.slice_size = rails_per_nic, slice_size
        self.max_notify, self.sq_depth, self.recv_depth = max_notify, sq_depth, recv_depth
        self.notify_slots = notify_slots
        self._bind, self._advertise = (host, port), advertise
        self._host: Host | None = None
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wr_ids = itertools.count(1)
        self._wr_owner: dict[int, RdmaRail] = {}
        self._peer_rails: dict[str, list[RdmaRail]] = {}
        self._inbound: dict[tuple[str, int], _Inbound] = {}
        self._side_locks: dict[int, threading.Lock] = {}
        self._mrs: dict[int, dict[str, tuple[Any, MrKey, MrKey]]] = {}
        self._local_keys: dict[str, dict[int, MrKey]] = {d.name: {} for d in self._devices}
        self._unwrap = ImmUnwrapper()
        self._seen: collections.OrderedDict[tuple[str, bytes, int, int], None] = (
            collections.OrderedDict())
        self._peer_failures: collections.Counter[str] = collections.Counter()
        self._dead: set[str] = set()  # devices lost to an asynchronous event
        self._rail_numbers: collections.Counter[str] = collections.Counter()
        self._closed = False

    # --- Transport interface ----------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        # One engine work becomes as many verbs requests as it has remote ranges (SGE
        # lists packed by ``build_work_requests``), so a work may scatter remotely and
        # hold many pieces: all of them are checked against the target's keys before
        # any is posted, and they share one doorbell.
        return Capabilities(
            max_sge=min(WORK_PIECES, self.sq_depth - 1),
            max_wr_bytes=min(d.max_msg_size for d in self._devices),
            remote_scatter=True, device_memory=self.provider == "pyverbs",
            default_rails=self.rails_per_nic * len(self._devices),
            slice_size=self.slice_size)

    def start(self, host: Host) -> dict[str, Any]:
        self._host = host
        listener = socket.create_server(self._bind, reuse_port=False)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop,
                                          name="te-rdma-side-accept", daemon=True)
        self._acceptor.start()
        addr = self._advertise or (self._bind[0] if self._bind[0] not in ("0.0.0.0", "::")
                                   else socket.getfqdn())
        info: dict[str, Any] = {"devices": [d.name for d in self._devices],
                                "endpoint": f"tcp://{addr}:{listener.getsockname()[1]}"}
        if self.provider != "pyverbs":  # absent for pyverbs: older peers pair unchanged
            info["provider"] = self.provider
            info["host_id"] = host.host_id
        return info

    def register(self, segment: Segment) -> dict[str, Any]:
        out: dict[str, list[int]] = {}
        done: dict[str, tuple[Any, MrKey, MrKey]] = {}
        try:
            for dev in self._devices:
                mr, base = dev.register(segment.address, segment.length, segment.device,
                                        writable=segment.writable, segment=segment.name)
                done[dev.name] = (mr, MrKey(base, segment.length, mr.lkey),
                                  MrKey(base, segment.length, mr.rkey))
                out[dev.name] = [base, segment.length, mr.rkey]
        except RegistrationError:
            for mr, _, _ in done.values():
                mr.close()  # nothing stays registered
            raise
        with self._lock:
            self._mrs[segment.id] = done
            for name, (_, lkey, _) in done.items():
                self._local_keys[name][segment.id] = lkey
        return {"mrs": out}

    def deregister(self, segment: Segment) -> None:
        with self._lock:
            done = self._mrs.pop(segment.id, {})
            for name in done:
                self._local_keys[name].pop(segment.id, None)
        for mr, _, _ in done.values():
            mr.close()  # later remote access fails with REM_ACCESS_ERR at the initiator

    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        info = peer_meta.get("transports", {}).get("rdma")
        if not (info and info.get("devices") and info.get("endpoint")):
            return False
        if info.get("provider", "pyverbs") != self.provider:
            return False  # a real NIC and an emulated one share no fabric
        return self.provider == "pyverbs" or (
            self._host is not None and info.get("host_id") == self._host.host_id)

    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = 10.0, credential: Credential | None = None
                ) -> Rail:
        if self._closed or self._host is None:
            raise ClosedError("transport is closed or not started", peer=peer,
                              transport="rdma", op="connect")
        if credential is None:
            raise AuthenticationError("no rail ticket: connect through the engine's "
                                      "handshake", peer=peer, transport="rdma",
                                      op="connect")
        remote_devs = list(info.get("devices") or [])
        endpoint = str(info.get("endpoint", ""))
        if not remote_devs or not endpoint.startswith("tcp://"):
            raise ConnectError(f"peer published no rdma devices/endpoint: {info!r:.120}",
                               peer=peer, transport="rdma", op="connect")
        with self._lock:
            # never reused, even after a rail closed: the target counts immediates
            # per (transfer, rail index), so two live rails must not share one
            index = self._rail_numbers[peer]
            self._rail_numbers[peer] += 1
            self._peer_rails.setdefault(peer, [])
        li, ri = stripe_pairs(len(self._devices), len(remote_devs), index)
        dev, remote_dev = self._devices[li], str(remote_devs[ri])
        hostport = endpoint[len("tcp://"):].rsplit(":", 1)
        qp = dev.create_qp(send_wr=self.sq_depth, recv_wr=1, send_sge=dev.max_sge)
        psn = random_psn()
        try:
            sock = socket.create_connection((hostport[0].strip("[]"), int(hostport[1])),
                                            timeout=timeout)
        except TimeoutError as exc:
            dev.destroy_qp(qp)
            raise TransferTimeout(f"side channel {endpoint} timed out", peer=peer,
                                  transport="rdma", op="connect") from exc
        except OSError as exc:
            dev.destroy_qp(qp)
            raise ConnectError(f"cannot reach side channel {endpoint}: {exc}", peer=peer,
                               transport="rdma", op="connect") from exc
        try:
            sock.settimeout(timeout)
            challenge = _recv_frame(sock, peer).get("challenge")
            if not isinstance(challenge, bytes) or not challenge.startswith(CHALLENGE_MAGIC):
                raise ProtocolError("the side channel sent no challenge", peer=peer,
                                    transport="rdma")
            nonce, proof = credential.opening("rdma", challenge)
            _send_frame(sock, {"kind": "connect", "rail": index, "device": remote_dev,
                               "ticket": credential.ticket, "nonce": nonce, "proof": proof,
                               "qp": dev.qp_info(qp, psn).to_wire()})
            reply = _recv_frame(sock, peer)
            answer = reply.get("proof")
            credential.check_answer("rdma", challenge, nonce,
                                    answer if isinstance(answer, bytes) else b"")
            sock.settimeout(None)
            theirs = QpInfo.from_wire(reply.get("qp"), peer)
            dev.connect_qp(qp, psn, theirs, negotiate_mtu(dev.mtu, theirs.mtu), peer=peer)
            keys = _keys_from_wire(reply.get("segments", {}))
        except TransferError as exc:
            sock.close()
            dev.destroy_qp(qp)
            exc.with_context(peer=peer, op="connect", transport="rdma")
            raise
        except OSError as exc:
            sock.close()
            dev.destroy_qp(qp)
            raise ConnectError(f"rdma handshake failed: {exc}", peer=peer,
                               transport="rdma", op="connect") from exc
        rail = RdmaRail(self, peer, index, dev, remote_dev, qp, sock, keys, on_complete)
        with self._lock:
            self._peer_rails[peer].append(rail)
            self._side_locks[id(rail)] = threading.Lock()
        return rail

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            rails = [r for rs in self._peer_rails.values() for r in rs]
            inbound = list(self._inbound.values())
        for rail in rails:
            rail.close()
        if self._listener is not None:
            try:  # close() alone does not wake a thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        with self._lock:
            socks = list(self._side_socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads serving them
            except OSError:
                pass
        for dev in self._devices:
            dev.stop()  # pollers first: nothing touches a QP being destroyed
        for conn in inbound:
            conn.close()
        for done in self._mrs.values():
            for mr, _, _ in done.values():
                mr.close()
        self._mrs.clear()
        for dev in self._devices:
            dev.close()

    def spread(self, rails: Sequence[Rail]) -> int:
        """One rail per NIC pair carries a transfer: a second queue pair on the same
        NICs adds no bandwidth to it, only more requests to post and complete; the
        other rails carry concurrent transfers."""
        pairs = {(getattr(r, "device", None), getattr(r, "remote_device", None))
                 for r in rails}
        return max(1, min(len(rails), len(pairs)))

    def emulated_nics(self) -> list[Any]:
        """The emulated provider's NICs (``rdma_emulated.Nic``: counters, ``copy``,
        ``fail``); empty on pyverbs."""
        return [d.nic for d in self._devices if hasattr(d, "nic")]

    def info(self, key: str) -> Any:
        if key == "devices":
            return [d.name for d in self._devices]
        if key == "peer_failures":
            return dict(self._peer_failures)
        if key == "stripe_weights":
            return [d.link_rate_gbps or 1.0 for d in self._devices]
        return None

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "OPEN"
        return (f"<RdmaTransport devices={[d.name for d in self._devices]} "
                f"rails={sum(map(len, self._peer_rails.values()))} {state}>")

    # --- helpers the rails use --------------------------------------------------------

    def local_keys(self, device: str) -> dict[int, MrKey]:
        return self._local_keys[device]

    def new_wr_id(self, rail: RdmaRail) -> int:
        wr_id = next(self._wr_ids)
        self._wr_owner[wr_id] = rail
        return wr_id

    @contextmanager
    def side_lock(self, rail: RdmaRail) -> Iterator[None]:
        with self._side_locks.setdefault(id(rail), threading.Lock()):
            yield

    def defer(self, device: Device, fn: Any, *args: Any) -> None:
        device.call_soon(fn, *args)

    def sibling(self, rail: RdmaRail) -> RdmaRail | None:
        """An open rail to the same peer for a failed one's work: one on a live NIC
        other than the failed rail's first (its NIC may be what failed)."""
        with self._lock:
            rails = [r for r in self._peer_rails.get(rail.peer, [])
                     if r is not rail and not r.closed and r.device.name not in self._dead]
        rails.sort(key=lambda r: (r.device is rail.device, r.remote_device
                                  == rail.remote_device, r.inflight))
        return rails[0] if rails else None

    def _on_device_event(self, device: Any, kind: int) -> None:
        """An asynchronous event of a NIC (its completion thread): a lost device or an
        overrun completion queue fails every rail on it, whose work moves to rails on
        other NICs; later rails avoid it."""
        log.error("rdma device %s: asynchronous event %d; its rails fail over",
                  device.name, kind)
        with self._lock:
            self._dead.add(device.name)
            rails = [r for rs in self._peer_rails.values() for r in rs
                     if r.device is device and not r.closed]
        for rail in rails:
            rail.fail(PeerLostError(f"rdma device {device.name} failed", peer=rail.peer,
                                    transport="rdma"))

    def forget_wr_ids(self, wr_ids: list[int]) -> None:
        for wr_id in wr_ids:
            self._wr_owner.pop(wr_id, None)

    def note_failure(self, peer: str) -> None:
        self._peer_failures[peer] += 1

    def forget_rail(self, rail: RdmaRail) -> None:
        with self._lock:
            rails = self._peer_rails.get(rail.peer, [])
            if rail in rails:
                rails.remove(rail)
            self._side_locks.pop(id(rail), None)

    # --- completions (poller threads) -------------------------------------------------

    def _on_wc(self, device: Device, wc: Any) -> None:
        if wc.wr_id & _RECV_BIT:
            self._on_recv(device, wc)
            return
        rail = self._wr_owner.pop(wc.wr_id, None)
        if rail is not None:
            rail.on_wc(wc.wr_id, wc.status, wc.vendor_err)

    def _on_recv(self, device: Device, wc: Any) -> None:
        key, index = (wc.wr_id & ~_RECV_BIT) >> 20, wc.wr_id & 0xFFFFF
        conn = device.inbound(key)
        if conn is None or wc.status != 0:
            return  # a flushed receive of a failed or closing QP: never re-posted
        try:
            if wc.opcode == WcOpcode.RECV_RDMA_WITH_IMM:
                wrapped, expected = decode_imm(socket.ntohl(wc.imm_data))
                with self._lock:
                    tid = self._unwrap.full_id(conn.peer, wrapped)
                self._deliver(conn.peer, tid, expected, conn.rail, None, conn.origin)
            else:
                data = conn.payload(index, min(wc.byte_len, conn.slot))
                tid, expected, origin, payload = unpack_notify(data, conn.peer)
                with self._lock:
                    self._unwrap.observe(conn.peer, tid)
                self._deliver(conn.peer, tid, expected, origin, payload, conn.origin)
        except TransferError as exc:
            log.warning("dropped a malformed rdma immediate from %s: %s", conn.peer, exc)
        finally:
            conn.post_recv(index)

    def _deliver(self, peer: str, tid: int, expected: int, origin: int,
                 payload: bytes | None, ticket: bytes = b"") -> None:
        seen = (peer, ticket, tid, origin)  # per connection, as the engine counts
        with self._lock:  # one poller thread per NIC: they share this table
            if seen in self._seen:
                return  # the same rail's immediate again, after a retry elsewhere
            self._seen[seen] = None
            if len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)
        if self._host is not None:
            self._host.deliver_immediate(peer, Immediate(tid, expected, payload), ticket)

    # --- side channel (target role) ---------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        backoff = 0.0
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, None):
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    backoff = min(1.0, backoff * 2 or 0.01)
                    time.sleep(backoff)
                continue
            backoff = 0.0
            with self._lock:
                crowded = len(self._side_socks) >= _MAX_SIDE
            if crowded:
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock,), name="te-rdma-side",
                                 daemon=True).start()
            except RuntimeError:
                sock.close()

    def _segments_for(self, device: str, ids: list[int] | None) -> dict[int, list[int]]:
        with self._lock:
            return {sid: [r.base, r.length, r.key] for sid, d in self._mrs.items()
                    if (ids is None or sid in ids) and device in d
                    for r in (d[device][2],)}

    def _serve(self, sock: socket.socket) -> None:
        conn: _Inbound | None = None
        peer: str | None = None
        with self._lock:
            self._side_socks.add(sock)
        ticket: Ticket | None = None
        try:
            ticket, proof, msg = self._open_side(sock)
            sock.settimeout(None)
            peer, rail, want = ticket.peer, int(msg["rail"]), str(msg["device"])
            dev = self._by_name.get(want)
            if msg.get("kind") != "connect" or dev is None:
                raise ConnectError(f"no rdma device {want!r} here", peer=peer)
            theirs = QpInfo.from_wire(msg.get("qp"), peer)
            conn = _Inbound(dev, peer, rail, self.recv_depth,
                            NOTIFY_HEADER.size + self.max_notify)
            conn.origin = ticket.id
            psn = random_psn()
            dev.connect_qp(conn.qp, psn, theirs, negotiate_mtu(dev.mtu, theirs.mtu),
                           peer=peer)
            dev.add_inbound(conn)
            with self._lock:
                self._inbound[(peer, conn.key)] = conn
            _send_frame(sock, {"qp": dev.qp_info(conn.qp, psn).to_wire(), "proof": proof,
                               "segments": self._segments_for(want, None)})
            while not self._closed:
                msg = _recv_frame(sock, peer)
                ids = [int(i) for i in msg.get("ids", [])]
                _send_frame(sock, {"segments": self._segments_for(want, ids)})
        except _SideRefused:
            try:  # a bare refusal: a stranger learns nothing
                _send_frame(sock, {"error": error_code(AuthenticationError("")),
                                   "message": "rail refused"})
            except OSError:
                pass
        except (TransferError, KeyError, ValueError, TypeError) as exc:
            if not isinstance(exc, PeerLostError):
                try:
                    code = error_code(exc) if isinstance(exc, TransferError) else 2
                    _send_frame(sock, {"error": code, "message": str(exc)})
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._side_socks.discard(sock)
            sock.close()
            if ticket is not None:
                ticket.release()
            if conn is not None:
                conn.device.remove_inbound(conn)
                with self._lock:
                    self._inbound.pop((conn.peer, conn.key), None)
                if not self._closed:
                    conn.close()
                if peer is not None and not self._peer_has_inbound(peer):
                    with self._lock:
                        self._unwrap.forget(peer)

    def _open_side(self, sock: socket.socket) -> tuple[Ticket, bytes, dict[str, Any]]:
        """The side channel's opening: our challenge, the peer's ticket and proof (the
        same as a stream rail's, see :mod:`~transfer_engine.control.tickets`); returns
        the ticket, our answer and the connect message. Raises :class:`_SideRefused`."""
        assert self._host is not None
        sock.settimeout(HELLO_TIMEOUT)
        challenge = new_challenge()
        try:
            _send_frame(sock, {"challenge": challenge})
            msg = _recv_frame(sock, None, limit=_MAX_OPENING_FRAME)
            if msg.get("kind") != "connect":
                raise _SideRefused("no connect")
            ticket, proof = self._host.admit_rail(msg.get("ticket"), "rdma", challenge,
                                                  msg.get("nonce"), msg.get("proof"))
        except (TransferError, OSError) as exc:
            raise _SideRefused(str(exc)) from None
        return ticket, proof, msg

    def _peer_has_inbound(self, peer: str) -> bool:
        with self._lock:
            return any(p == peer for p, _ in self._inbound)

