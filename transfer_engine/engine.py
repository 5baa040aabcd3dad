"""The Engine: one per process; owns transports, segments, peers and transfers.

    with Engine("decode-0") as engine:                      # control endpoint + transports
        seg = engine.register(kv_tensor)                    # a Segment (context manager)
        peer = engine.connect("tcp://10.0.0.5:7000")        # peer-to-peer handshake
        dst = peer.segment("kv")
        h = engine.write(peer, [(Descriptor(seg, 0, n), Descriptor(dst, 0, n))],
                         notify=b"req-17")
        h.wait(timeout=5)

Closing the engine closes, in reverse order of creation, its peers (their rails fail
in-flight transfers with ``ClosedError``), its transports, its segments and its control
endpoint.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import zmq

from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig, check_exposure, open_request, seal
from transfer_engine.control.messages import (
    Denied,
    ErrorReply,
    Hello,
    Message,
    SegmentsReply,
    SegmentsRequest,
    Welcome,
)
from transfer_engine.control.metastore import (
    EventKind,
    MemberEvent,
    MemberRecord,
    MetadataStore,
    RegistryStore,
)
from transfer_engine.control.tickets import Credential, Ticket, TicketBook
from transfer_engine.descriptor import Blocks, Descriptor, Op
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    TransferEngineError,
    TransferError,
    TransferTimeout,
    UnknownPeerError,
)
from transfer_engine.handle import TransferHandle
from transfer_engine.notify import ImmediateCounter, Notification
from transfer_engine.peer import ControlClient, Peer
from transfer_engine.planner import Columns, WorkRequest, plan_columns
from transfer_engine.segment import RemoteSegment, Segment, describe_memory
from transfer_engine.transport import load_transport
from transfer_engine.transport.base import Completion, Immediate, Rail, Transport, Work
from transfer_engine.transport.iovec import iovec_array
from transfer_engine.transport.shm import host_id
from transfer_engine.watchdog import Watchdog

__all__ = ["Engine", "Pairs"]

Pairs = Sequence[tuple[Descriptor, Descriptor]] | Blocks | Sequence[Blocks]
"""What a transfer moves: descriptor pairs, or the same as :class:`Blocks` arrays."""

log = logging.getLogger(__name__)

DEFAULT_TRANSPORTS = ("shm", "rdma", "tcp")  # best first; missing ones are skipped
# Failures after which the same transfer is repeated over the peer's next transport.
_FALLBACK_ERRORS = (NotSupportedError, PeerLostError)
_BYTES_STAT = {Op.WRITE: "bytes_write", Op.READ: "bytes_read"}


def _usable(peer: Peer) -> bool:
    """Whether ``peer`` can carry a transfer now: not lost, with a transport whose rails
    are open."""
    return peer.lost is None and any(
        rails and not all(rail.closed for rail in rails)
        for name, rails in peer.rails.items() if name in peer.order)


def _in_bounds(nums: np.ndarray, llen: int | np.ndarray, rlen: int | np.ndarray
               ) -> tuple[int, int] | None:
    """``(bytes, block)`` of the (local offset, local length, remote offset, remote
    length) columns of ``nums`` if every pair is a non-empty range inside its segments
    with equal lengths on both sides, else None; ``block`` is the one length of every
    pair, or 0 when they differ."""
    lo, ll, ro, rl = nums
    if isinstance(llen, int) and isinstance(rlen, int):
        low, high = nums.min(axis=1).tolist(), nums.max(axis=1).tolist()
        if 0 < low[1] == high[1] == low[3] == high[3]:  # one block length: the extremes
            ok = (low[0] >= 0 and low[2] >= 0 and high[0] + high[1] <= llen
                  and high[2] + high[1] <= rlen)
            return (len(ll) * high[1], high[1]) if ok else None
    # subtracting keeps every term in range: no int64 wrap-around
    ok = (ll > 0) & (lo >= 0) & (ro >= 0) & (lo <= llen - ll) & (ro <= rlen - ll)
    if bool(ok.all()) and bool(np.array_equal(ll, rl)):
        return int(ll.sum()), 0
    return None


def _blocks_in_bounds(g: Blocks, llen: int, rlen: int) -> tuple[int, int] | None:
    """:func:`_in_bounds` for one :class:`Blocks`; no NumPy call when its pairs share
    one length (the Blocks measured its largest offsets when it was built)."""
    block = g.block
    if block > 0:
        lmax, rmax = g._reach or (0, 0)  # the largest offsets, seen unsigned
        if block <= llen and block <= rlen and lmax <= llen - block and rmax <= rlen - block:
            return len(g.local_offsets) * block, block
        return None
    if block < 0:
        return None
    return _in_bounds(np.stack((g.local_offsets, g.lengths, g.remote_offsets, g.lengths)),
                      llen, rlen)


@dataclass(eq=False)
class _Transfer:
    """Engine-side state of one transfer across its attempts."""

    handle: TransferHandle
    peer: Peer
    op: Op
    extents: Columns
    notify: bytes | None
    transports: list[str]
    local_segments: list[Segment]
    remaining: int = 0
    error: TransferError | None = None
    notifying: bool = False
    started: float = 0.0  # monotonic start of the current attempt
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    posted: list[tuple[Rail, Work]] | None = None  # the current attempt's work
    posting: bool = False  # rail.post calls of ``posted`` under way
    stopping: TransferError | None = None  # why it was cancelled (or timed out)


class Engine(Closeable):
    """A transfer engine instance.

    :param name: unique name of this engine among its peers.
    :param host: address the control endpoint and the TCP transport listen on.
    :param port: control endpoint port; 0 picks a free one.
    :param transports: transport names (``"tcp"``, ``"shm"``, ``"rdma"``, or
        ``"module:Class"``) or built :class:`Transport` objects, best first. Default:
        ``$TE_TRANSPORTS`` or ``shm,rdma,tcp``. A named transport that cannot load here
        (missing library or device) is skipped with a log line; built ones are used as
        given.
    :param timeout: seconds for handshakes and control requests.
    :param registry: membership to join: a registry endpoint (``tcp://host:port``, see
        :mod:`transfer_engine.control.registry`) or any
        :class:`~transfer_engine.control.metastore.MetadataStore` (not closed by the
        engine). ``None``: peer-to-peer only (``connect`` with endpoints).
    :param role: ``prefill``, ``decode``, ``store`` or ``any``, published to the registry.
    :param pod: placement labels published to the registry.
    :param zone: placement labels published to the registry.
    :param auth: signing of control messages (handshake and registry): an
        :class:`~transfer_engine.control.auth.AuthConfig`, or the shared secret itself
        (``str``/``bytes``, at least 16 bytes). Default: ``AuthConfig.from_env()``
        (``$TE_CONTROL_SECRET``), unsigned when that is unset. Rails are bound to
        handshaken peers either way (:mod:`~transfer_engine.control.tickets`).
    :param insecure: without a secret the engine serves loopback only; ``True`` (or
        ``$TE_ALLOW_INSECURE=1``) lets it serve another address anyway, with a warning:
        then anyone who reaches the control port can handshake and move bytes.
    :param transfer_timeout: default deadline of every transfer, in seconds (a
        transfer's own ``timeout=`` overrides it); past it the transfer fails with
        :class:`TransferTimeout` as a cancel would. ``None`` (default): no deadline,
        since a transfer may rightly take long; a silent peer is caught by
        ``peer_timeout`` anyway.
    :param peer_timeout: seconds a peer with transfers in flight may leave control
        probes unanswered before it is declared lost (:meth:`peer_lost`). Probing
        starts once a transfer is in flight for ``min(1, peer_timeout / 5)`` seconds;
        idle peers are not probed. ``None`` disables it.
    """

    _watchdog: Watchdog | None = None  # started with the first transfer

    def __init__(self, name: str, *, host: str = "127.0.0.1", port: int = 0,
                 transports: Sequence[str | Transport] | None = None,
                 timeout: float = 10.0, registry: str | MetadataStore | None = None,
                 role: str = "any", pod: str = "", zone: str = "",
                 auth: AuthConfig | str | bytes | None = None,
                 insecure: bool | None = None,
                 transfer_timeout: float | None = None,
                 peer_timeout: float | None = 10.0) -> None:
        self.name = name
        self.transfer_timeout = transfer_timeout
        self.peer_timeout = peer_timeout
        self.host = host
        self.timeout = timeout
        self.host_id = host_id()
        self._lock = threading.RLock()
        self._closed = False
        self._stack = ExitStack()
        self._segments: dict[int, Segment] = {}
        self._segment_names: dict[str, Segment] = {}
        self._seg_ids = itertools.count(1)
        self._transfer_ids = itertools.count(1)
        self._wr_ids = itertools.count(1)
        self._peers: dict[str, Peer] = {}
        self._live: dict[int, _Transfer] = {}
        self._by_address: dict[str, Peer] = {}  # control endpoint -> its peer
        self._connecting: dict[str, Future[Peer]] = {}  # handshakes under way
        self._retired: set[Peer] = set()  # replaced, closed when their transfers end
        self._counter = ImmediateCounter()
        self._notes: collections.deque[Notification] = collections.deque()
        self._notes_cond = threading.Condition(self._lock)
        self._callbacks: list[Callable[[Notification], None]] = []
        self.stats = collections.Counter[str]()
        self.incarnation = uuid.uuid4().hex[:16]
        self.role, self.pod, self.zone = role, pod, zone
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self._signer = auth.signer()
        self._secret = auth.key if auth.secret is not None else None
        check_exposure(host, self._secret is not None, insecure, what=f"engine {name!r}")
        self._tickets = TicketBook(self._secret, name)
        self._ranges: np.ndarray | None = None  # local_ranges(), rebuilt on (de)register
        self.membership: MetadataStore | None = None
        try:
            self._start_control(host, port)
            self._transports = self._start_transports(transports)
            if registry is not None:
                self._join(registry, auth)
        except BaseException:
            self._stack.close()
            raise

    # --- set-up -----------------------------------------------------------------------

    def _start_control(self, host: str, port: int) -> None:
        self._zctx: zmq.Context[Any] = zmq.Context()
        self._stack.callback(self._zctx.term)
        self._router = self._zctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
        self._stack.callback(self._router.close, 0)
        if ":" in host and not host.startswith("["):
            self._router.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{host}]"
        else:
            bind_host = host
        if port:
            self._router.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._control_stop = threading.Event()
        self._control_thread = threading.Thread(target=self._control_loop, daemon=True,
                                                name=f"te-control-{self.name}")
        self._control_thread.start()
        self._stack.callback(self._control_thread.join, 5)
        self._stack.callback(self._control_stop.set)

    def _start_transports(self, specs: Sequence[str | Transport] | None
                          ) -> dict[str, Transport]:
        if specs is None:
            env = os.environ.get("TE_TRANSPORTS")
            specs = [s.strip() for s in env.split(",") if s.strip()] if env else list(
                DEFAULT_TRANSPORTS)
        out: dict[str, Transport] = {}
        self._transport_info: dict[str, dict[str, Any]] = {}
        first_error: Exception | None = None
        for spec in specs:
            if isinstance(spec, Transport):
                transport = spec
            else:
                try:
                    kwargs = {"host": self.host} if spec in ("tcp", "rdma") else {}
                    transport = load_transport(spec, **kwargs)
                except TransferEngineError as exc:
                    log.info("transport %s unavailable: %s", spec, exc)
                    first_error = first_error or exc
                    continue
            self._stack.callback(transport.close)
            self._transport_info[transport.name] = transport.start(self)
            out[transport.name] = transport
        if not out:
            raise NotSupportedError(f"no usable transport among {list(specs)}: {first_error}")
        return out

    # --- Host protocol (called by transports) -----------------------------------------

    def local_segment(self, segment_id: int, *, peer: str | None = None,
                      op: str | None = None) -> Segment:
        seg = self._segments.get(segment_id)
        if seg is None or seg.closed:
            raise InvalidDescriptorError("unknown or deregistered segment", peer=peer, op=op,
                                         segment=segment_id)
        return seg

    def deliver_immediate(self, peer: str, imm: Immediate, origin: bytes = b"") -> None:
        with self._lock:
            try:
                note = self._counter.arrive(peer, imm.transfer_id, imm.expected, imm.notify,
                                            origin)
            except ValueError as exc:
                log.warning("bad immediate from %s: %s", peer, exc)
                return
            if note is None:
                return
            self._notes.append(note)
            self.stats["notifications"] += 1
            self._notes_cond.notify_all()
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(note)
            except Exception:
                log.exception("notification callback failed")

    def admit_rail(self, ticket: object, transport: str, challenge: bytes, nonce: object,
                   proof: object) -> tuple[Ticket, bytes]:
        return self._tickets.admit(ticket, transport, challenge, nonce, proof)

    def local_ranges(self) -> np.ndarray:
        ranges = self._ranges
        if ranges is None:
            with self._lock:
                segs = [s for s in self._segments.values()
                        if not s.closed and s.device == "cpu"]
                ranges = np.array([(s.address, s.length, int(s.writable)) for s in segs],
                                  dtype=np.uint64).reshape(-1, 3)
                self._ranges = ranges
        return ranges

    # --- metadata and control endpoint ------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        with self._lock:
            segments = [s.to_wire() for s in self._segments.values() if not s.closed]
        return {"name": self.name, "host_id": self.host_id, "hostname": socket.gethostname(),
                "pid": os.getpid(), "control": self.endpoint,
                "incarnation": self.incarnation,
                "transports": dict(self._transport_info), "segments": segments}

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._control_stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._control_stop.is_set():
                    return
                continue
            if len(frames) != 2:
                self.stats["control_rejected"] += 1
                if len(frames) > 2:  # answer, so that the sender's next request pairs up
                    try:
                        self._router.send_multipart(
                            [frames[0], seal(ErrorReply("expected a single-frame message"),
                                             self._signer)], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                continue
            ident, data = frames
            signed = True
            try:
                reply = self._handle_control(open_request(data, self._signer, peer="?"))
            except AuthenticationError as exc:
                self.stats["control_rejected"] += 1
                self.stats["control_denied"] += 1
                log.warning("control message refused: %s", exc)
                reply, signed = Denied(exc.message), False
            except TransferError as exc:
                self.stats["control_rejected"] += 1
                log.warning("control message rejected: %s", exc)
                reply = ErrorReply(str(exc))
            except Exception as exc:  # never let a message kill the endpoint
                log.exception("control message failed")
                reply = ErrorReply(f"internal error: {exc!r}")
            try:
                self._router.send_multipart(
                    [ident, seal(reply, self._signer if signed else None)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _handle_control(self, msg: Message) -> Message:
        if isinstance(msg, Hello):
            name = msg.meta.get("name")
            if not isinstance(name, str) or not name:
                raise ProtocolError("hello without a name")
            if name == self.name:
                raise ProtocolError(f"peer uses our own name {name!r}")
            pid = msg.meta.get("pid")
            ticket = self._tickets.issue(name, pid if isinstance(pid, int) else 0)
            return Welcome(self.metadata(), ticket)
        if isinstance(msg, SegmentsRequest):
            return SegmentsReply(self.metadata()["segments"])
        raise ProtocolError(f"unexpected {msg.kind} on the control endpoint")

    # --- segments ---------------------------------------------------------------------

    def register(self, obj: Any, name: str | None = None) -> Segment:
        """Registers memory so that peers can reach it; returns a :class:`Segment` that
        deregisters on ``close()`` (or at the end of a ``with`` block).

        ``obj``: a CPU torch tensor, a numpy array, a writable buffer (bytearray,
        memoryview, mmap) or a raw ``(address, length)`` tuple (the caller keeps that
        memory alive). Raises :class:`RegistrationError`; nothing stays registered.
        """
        self._check_open("register")
        info = describe_memory(obj)
        with self._lock:
            seg_id = next(self._seg_ids)
            name = name or f"{self.name}/seg{seg_id}"
            if name in self._segment_names:
                from transfer_engine.errors import RegistrationError
                raise RegistrationError("a segment of that name is registered", segment=name)
            seg = Segment(seg_id, name, info, on_close=self._deregister,
                          on_stuck=self._segment_stuck)
            done: list[Transport] = []
            try:
                for transport in self._transports.values():
                    keys = transport.register(seg)
                    done.append(transport)
                    if keys:
                        seg.keys[transport.name] = keys
            except BaseException:
                for transport in done:
                    transport.deregister(seg)
                raise
            self._segments[seg_id] = seg
            self._segment_names[name] = seg
            self._ranges = None
            self._stack.callback(seg.close)
        self._publish()
        return seg

    def _deregister(self, seg: Segment) -> None:
        with self._lock:
            self._segments.pop(seg.id, None)
            self._segment_names.pop(seg.name, None)
            self._ranges = None
        for transport in self._transports.values():
            transport.deregister(seg)
        self._publish()

    @property
    def segments(self) -> dict[str, Segment]:
        with self._lock:
            return dict(self._segment_names)

    # --- peers ------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> Peer:
        """Handshakes with the engine at ``address`` (its ``endpoint``, or with a
        registry, its member name) and opens rails on every transport both sides share,
        best first. Returns the :class:`Peer`.

        One connection per peer, whoever asks: a peer already connected at ``address``
        with open rails is returned as it is; concurrent calls for one address share one
        handshake (later callers wait for it and get its peer or its error). A peer
        replaced by a new connection (it restarted, or was reached by another address)
        keeps its rails until the transfers already on them have finished.
        """
        self._check_open("connect")
        timeout = self.timeout if timeout is None else timeout
        if "://" not in address:
            return self.connect_name(address, timeout)
        with self._lock:
            known = self._by_address.get(address)
            if known is not None and self._peers.get(known.name) is known and _usable(known):
                return known
            pending = self._connecting.get(address)
            if pending is None:
                pending = self._connecting[address] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            try:
                return pending.result(timeout)
            except FutureTimeout:
                raise TransferTimeout(f"another connect to {address} did not finish in "
                                      f"{timeout}s", peer=address, op="connect") from None
        try:
            peer = self._handshake(address, timeout)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._connecting.pop(address, None)
        pending.set_result(peer)
        return peer

    def _handshake(self, address: str, timeout: float) -> Peer:
        client = ControlClient(self._zctx, address, peer=address, auth=self._signer)
        try:
            reply = client.request(Hello(self.metadata()), timeout)
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"expected welcome, got {reply.kind}", peer=address)
            meta = reply.meta
            name = meta.get("name")
            if not isinstance(name, str) or not name:
                raise ProtocolError("welcome without a name", peer=address)
            client.peer = name
            credential = Credential.from_welcome(reply.ticket, self._secret, name, self.name)
            peer = Peer(meta, client, timeout)
        except BaseException:
            client.close()
            raise
        with self._lock:
            old = self._peers.get(name)
        if (old is not None and _usable(old)
                and old.meta.get("incarnation") == meta.get("incarnation")):
            peer.close()  # the same engine, reached by another address: one connection
            with self._lock:
                self._by_address[address] = old
            return old
        try:
            self._open_rails(peer, timeout, credential)
        except BaseException:
            peer.close()
            raise
        with self._lock:
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = peer
            self._by_address[address] = peer
            self._stack.callback(peer.close)
            busy = old is not None and any(x.peer is old for x in self._live.values())
            if old is not None and busy:
                self._retired.add(old)  # closed once its transfers are done
        if old is not None and not busy:
            old.close()
        return peer

    def _open_rails(self, peer: Peer, timeout: float, credential: Credential) -> None:
        errors: list[str] = []
        for name, transport in self._transports.items():
            info = peer.meta.get("transports", {}).get(name)
            if not info or not transport.reachable(peer.meta):
                continue
            rails = []
            try:
                for _ in range(max(1, transport.capabilities.default_rails)):
                    rails.append(transport.connect(peer.name, info, self._on_complete,
                                                   timeout, credential))
            except TransferError as exc:
                for rail in rails:
                    rail.close()
                errors.append(f"{name}: {exc}")
                log.info("no %s rails to %s: %s", name, peer.name, exc)
                continue
            peer.rails[name] = rails
            peer.order.append(name)
        if not peer.order:
            raise ConnectError(f"no common transport ({'; '.join(errors) or 'none shared'})",
                               peer=peer.name, op="connect")

    # --- membership (registry) --------------------------------------------------------

    def _member_record(self) -> MemberRecord:
        meta = self.metadata()
        rdma = self._transports.get("rdma")
        nics = list(rdma.info("devices") or []) if rdma is not None else []
        return MemberRecord(self.name, self.incarnation, self.role, meta["hostname"],
                            self.pod, self.zone, self.endpoint, meta["transports"], nics,
                            meta["segments"])

    def _join(self, registry: str | MetadataStore, auth: AuthConfig) -> None:
        if isinstance(registry, str):
            store: MetadataStore = RegistryStore(registry, auth=auth, timeout=self.timeout,
                                                 name=self.name)
            self._stack.callback(store.close)
        else:
            store = registry
        store.put(self._member_record(), self.timeout)
        self._stack.callback(self._leave, store)
        self._stack.callback(store.watch(self._on_member_event).close)
        self.membership = store

    def _leave(self, store: MetadataStore) -> None:
        try:
            store.delete(self.name, min(self.timeout, 2.0))
        except TransferEngineError as exc:
            log.info("leaving the registry: %s", exc)

    def _publish(self) -> None:
        """Sends our current record (segments changed) to the registry, without waiting."""
        store = self.membership
        if store is None or self._closed:
            return
        client = getattr(store, "client", None)
        if client is not None:
            client.update(self._member_record())
            return
        try:
            store.put(self._member_record(), self.timeout)
        except TransferEngineError as exc:
            log.info("publishing our record: %s", exc)

    def _on_member_event(self, event: MemberEvent) -> None:
        if event.name == self.name or self._closed:
            return
        with self._lock:
            peer = self._peers.get(event.name)
        if peer is None or peer.lost is not None:
            return
        if event.kind in (EventKind.LEAVE, EventKind.EXPIRE):
            self.peer_lost(event.name, f"registry: {event.kind.value} ({event.reason})")
        elif (event.kind is EventKind.JOIN and event.record is not None
              and peer.meta.get("incarnation") not in (None, event.record.incarnation)):
            self.peer_lost(event.name, "registry: restarted with a new incarnation")

    def connect_name(self, name: str, timeout: float | None = None) -> Peer:
        """Looks ``name`` up in the registry and connects to its control endpoint."""
        self._check_open("connect")
        if self.membership is None:
            raise UnknownPeerError("not an endpoint, and no registry to resolve a name",
                                   peer=name, op="connect")
        record = self.membership.get(name, self.timeout if timeout is None else timeout)
        return self.connect(record.control, timeout)

    def members(self, role: str | None = None) -> list[MemberRecord]:
        """Current registry members (all, or of one role); [] without a registry."""
        if self.membership is None:
            return []
        return self.membership.list(role, self.timeout)

    def peer_lost(self, name: str, reason: str = "peer lost") -> int:
        """Declares peer ``name`` gone (the registry calls this on leave or expiry).

        Its in-flight transfers fail at once with :class:`PeerLostError` (no fallback:
        every path to a lost peer is gone), its rails and control client close, and new
        transfers to it raise ``PeerLostError`` until :meth:`connect` succeeds again.
        Returns how many transfers were failed; unknown names are ignored.
        """
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or self._closed:
                return 0
            live = [x for x in self._live.values() if x.peer is peer]
            self._counter.forget_peer(name)  # its partial transfers never complete
        failed = 0
        for xfer in live:
            with xfer.lock:
                del xfer.transports[1:]
                if xfer.remaining > 0:
                    xfer.error = xfer.error or PeerLostError(
                        f"peer lost: {reason}", peer=name, op=str(xfer.op),
                        transport=xfer.transports[0] if xfer.transports else None)
                    failed += 1
        self.stats["peers_lost"] += 1
        log.warning("peer %s lost (%s): failing %d transfers", name, reason, failed)
        peer.fail(reason)  # closing rails completes their pending work with our error
        return failed

    def peer(self, name: str) -> Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError("no connected peer of that name", peer=name)
        return peer

    @property
    def peers(self) -> dict[str, Peer]:
        with self._lock:
            return dict(self._peers)

    # --- transfers --------------------------------------------------------------------

    def write(self, peer: Peer | str, pairs: Pairs, notify: bytes | None = None, *,
              timeout: float | None = None) -> TransferHandle:
        """Writes each local descriptor's bytes to its remote descriptor.

        ``pairs`` is a sequence of ``(local, remote)`` :class:`Descriptor` pairs, or a
        :class:`Blocks` (or a list of them): the same pairs as arrays, much cheaper for
        many small blocks. ``notify`` (bytes, at most 64 KiB) reaches the peer's
        :meth:`notifications` once every byte has landed, exactly once. ``timeout``:
        the transfer's deadline in seconds (default: the engine's
        ``transfer_timeout``); past it the handle fails with :class:`TransferTimeout`
        (see :meth:`TransferHandle.cancel` for what is stopped how). Raises
        :class:`InvalidDescriptorError` or :class:`UnknownPeerError` before anything
        moves.
        """
        return self._submit(Op.WRITE, peer, pairs, notify, timeout)

    def read(self, peer: Peer | str, pairs: Pairs, notify: bytes | None = None, *,
             timeout: float | None = None) -> TransferHandle:
        """Reads each remote descriptor's bytes into its local descriptor; ``notify``
        reaches the peer after all of them arrived here. ``timeout`` as for
        :meth:`write`."""
        return self._submit(Op.READ, peer, pairs, notify, timeout)

    def _submit(self, op: Op, peer_ref: Peer | str, pairs: Pairs,
                notify: bytes | None, timeout: float | None = None) -> TransferHandle:
        if self._closed:
            raise ClosedError("engine is closed", op=str(op))
        peer = self.peer(peer_ref if isinstance(peer_ref, str) else peer_ref.name)
        if peer.lost is not None:
            raise PeerLostError(f"peer lost: {peer.lost}", peer=peer.name, op=str(op))
        peer.reprobe()
        if peer.order == [] or peer.transport is None:
            raise PeerLostError("peer has no open rails", peer=peer.name, op=str(op))
        if notify is not None and (not isinstance(notify, bytes | bytearray)
                                   or len(notify) > 65536):
            raise InvalidDescriptorError("notify must be bytes of at most 64 KiB",
                                         peer=peer.name, op=str(op))
        extents, locals_ = self._validate(op, peer, pairs)
        nbytes = extents.nbytes
        handle = TransferHandle(next(self._transfer_ids), op, peer.name, nbytes)
        pinned: list[Segment] = []
        try:
            for seg in locals_:
                seg.pin()
                pinned.append(seg)
        except TransferError as exc:
            for seg in pinned:
                seg.unpin()
            raise exc.with_context(peer=peer.name, op=str(op)) from None
        xfer = _Transfer(handle, peer, op, extents, bytes(notify) if notify is not None else None,
                         list(peer.order), pinned)
        handle._canceller = self._cancel_handle
        with self._lock:
            self._live[handle.id] = xfer
        if timeout is None:
            timeout = self.transfer_timeout
        watchdog = self._watchdog
        if watchdog is None and (timeout is not None or self.peer_timeout is not None):
            watchdog = self._start_watchdog()
        if timeout is not None and watchdog is not None:
            watchdog.add(time.monotonic() + timeout, handle.id, timeout)
        self.stats["transfers"] += 1
        failure = self._start_attempt(xfer)
        if failure is not None:
            raise failure
        return handle

    def _validate(self, op: Op, peer: Peer, pairs: Pairs) -> tuple[Columns, list[Segment]]:
        """Checks every pair before anything moves; returns the pairs as planner columns
        and the local segments they use.

        One pass over the descriptors and a few array checks keep this cheap for
        thousands of small blocks; any failure is re-checked pair by pair for a precise
        error.
        """
        if isinstance(pairs, Blocks):
            return self._validate_blocks(op, peer, [pairs])
        if pairs and all(isinstance(g, Blocks) for g in pairs):
            return self._validate_blocks(op, peer, pairs)  # type: ignore[arg-type]
        if not pairs:
            raise InvalidDescriptorError("a transfer needs at least one pair", peer=peer.name,
                                         op=str(op))
        descs = cast(Sequence[tuple[Descriptor, Descriptor]], pairs)
        try:
            ls, lo, ll, rs, ro, rl = zip(*[(loc.segment, loc.offset, loc.length, rem.segment,
                                            rem.offset, rem.length) for loc, rem in descs],
                                         strict=True)
        except (TypeError, ValueError, AttributeError):
            ls = ()
        if ls:
            count = len(ls)
            uniform = ls.count(ls[0]) == count and rs.count(rs[0]) == count
            lsegs = [ls[0]] if uniform else list({id(s): s for s in ls}.values())
            rsegs = [rs[0]] if uniform else list({id(s): s for s in rs}.values())
            write = op is Op.WRITE
            segs_ok = all(isinstance(seg, Segment) and self._segments.get(seg.id) is seg
                          and not seg.closed and (write or seg.writable)
                          for seg in lsegs) and all(
                isinstance(seg, RemoteSegment) and seg.peer == peer.name
                and (seg.writable or not write) for seg in rsegs)
            try:
                nums = np.array((lo, ll, ro, rl)) if segs_ok else None
            except (TypeError, ValueError, OverflowError):
                nums = None
            if nums is not None and nums.dtype.kind == "i":
                nlo, nll, nro, _ = nums
                if uniform:
                    sized = _in_bounds(nums, lsegs[0].length, rsegs[0].length)
                else:
                    sized = _in_bounds(nums, np.array([s.length for s in ls], dtype=np.int64),
                                       np.array([s.length for s in rs], dtype=np.int64))
                if sized is not None:
                    nbytes, block = sized
                    if uniform:
                        cols = Columns.uniform(lsegs[0].id, nlo, rsegs[0].id, nro, nll,
                                               nbytes, block)
                    else:
                        cols = Columns(np.array([s.id for s in ls], dtype=np.int64), nlo,
                                       np.array([s.id for s in rs], dtype=np.int64), nro,
                                       nll, nbytes=nbytes)
                    return cols, [s for s in lsegs if isinstance(s, Segment)]
        self._validate_each(op, peer, pairs)
        raise InvalidDescriptorError("descriptors failed validation", peer=peer.name,
                                     op=str(op))

    def _validate_blocks(self, op: Op, peer: Peer, groups: Sequence[Blocks]
                         ) -> tuple[Columns, list[Segment]]:
        """:meth:`_validate` for arrays: a few array checks per segment pair (none for one
        Blocks of one length, which brings its own maxima and columns)."""
        write = op is Op.WRITE
        parts: list[tuple[Blocks, int]] = []
        for g in groups:
            lseg, rseg = g.local, g.remote
            if not len(g):
                continue
            sized = None
            if (isinstance(lseg, Segment) and self._segments.get(lseg.id) is lseg
                    and not lseg.closed and (write or lseg.writable)
                    and isinstance(rseg, RemoteSegment) and rseg.peer == peer.name
                    and (rseg.writable or not write)):
                sized = _blocks_in_bounds(g, lseg.length, rseg.length)
            if sized is None:
                self._validate_each(op, peer, g)
                raise InvalidDescriptorError("descriptors failed validation",
                                             peer=peer.name, op=str(op))
            parts.append((g, sized[0]))
        if not parts:
            raise InvalidDescriptorError("a transfer needs at least one pair", peer=peer.name,
                                         op=str(op))
        first = parts[0][0]
        if len(parts) == 1 and first._columns is not None:
            return first._columns, [first.local]
        total = sum(n for _, n in parts)
        lsegs = list({id(g.local): g.local for g, _ in parts}.values())
        counts = [len(g) for g, _ in parts]
        cols = Columns(np.repeat([g.local.id for g, _ in parts], counts),
                       np.concatenate([g.local_offsets for g, _ in parts]),
                       np.repeat([g.remote.id for g, _ in parts], counts),
                       np.concatenate([g.remote_offsets for g, _ in parts]),
                       np.concatenate([g.lengths for g, _ in parts]), nbytes=total)
        return cols, lsegs

    def _validate_each(self, op: Op, peer: Peer, pairs: Iterable[Any]) -> None:
        """Raises the precise error for the first bad pair."""
        for pair in pairs:
            try:
                local, remote = pair
            except (TypeError, ValueError) as exc:
                raise InvalidDescriptorError(f"not a (local, remote) pair: {pair!r:.80}",
                                             peer=peer.name, op=str(op)) from exc
            if not isinstance(local, Descriptor) or not isinstance(remote, Descriptor):
                raise InvalidDescriptorError("pairs hold Descriptor objects", peer=peer.name,
                                             op=str(op))
            lseg, rseg = local.segment, remote.segment
            if not isinstance(lseg, Segment) or self._segments.get(lseg.id) is not lseg:
                raise InvalidDescriptorError(
                    "local descriptor does not name a segment registered with this engine",
                    peer=peer.name, op=str(op), segment=getattr(lseg, "name", lseg),
                    offset=local.offset, length=local.length)
            if not isinstance(rseg, RemoteSegment) or rseg.peer != peer.name:
                raise InvalidDescriptorError(
                    "remote descriptor does not name a segment of this peer", peer=peer.name,
                    op=str(op), segment=getattr(rseg, "name", rseg), offset=remote.offset,
                    length=remote.length)
            if local.length != remote.length:
                raise InvalidDescriptorError(
                    f"local length {local.length} != remote length {remote.length}",
                    peer=peer.name, op=str(op), segment=rseg.name, offset=remote.offset,
                    length=remote.length)
            lseg.check(local.offset, local.length, write=op is Op.READ, op=str(op),
                       peer=peer.name)
            if remote.offset < 0 or remote.offset + remote.length > rseg.length:
                raise InvalidDescriptorError(
                    f"range out of bounds of remote segment of {rseg.length} bytes",
                    peer=peer.name, op=str(op), segment=rseg.name, offset=remote.offset,
                    length=remote.length)
            if op is Op.WRITE and not rseg.writable:
                raise InvalidDescriptorError("remote segment is read-only", peer=peer.name,
                                             op=str(op), segment=rseg.name,
                                             offset=remote.offset, length=remote.length)

    def _start_attempt(self, xfer: _Transfer) -> Exception | None:
        """Plans and posts the transfer's next attempt. Should that fail unexpectedly,
        the transfer fails (its segments unpinned, its handle finished) and the exception
        is returned, for :meth:`_submit` to raise; nothing is left waiting."""
        try:
            self._post_attempt(xfer)
        except Exception as exc:
            log.exception("transfer %d to %s could not start", xfer.handle.id,
                          xfer.peer.name)
            error = exc if isinstance(exc, TransferError) else ProtocolError(
                f"transfer could not start: {exc!r}", peer=xfer.peer.name, op=str(xfer.op))
            self._finish(xfer, error)
            return exc
        return None

    def _post_attempt(self, xfer: _Transfer) -> None:
        while True:  # rails torn down (a cancel, a dead connection) carry nothing more
            name = xfer.transports[0]
            rails = [rail for rail in xfer.peer.rails[name] if not rail.closed]
            if rails:
                break
            with xfer.lock:
                skip = len(xfer.transports) > 1 and xfer.stopping is None
                if skip:
                    xfer.transports.pop(0)
            if not skip:
                self._finish(xfer, PeerLostError("no open rails to the peer",
                                                 peer=xfer.peer.name, op=str(xfer.op),
                                                 transport=name))
                return
            xfer.peer.demote(name)
        transport = self._transports[name]
        if len(rails) > 1:
            # the least busy of the active rails first: a transfer smaller than two
            # shares goes to an idle rail, and a lone caller keeps to one warm connection
            # (alternating between idle ones measured slower)
            rails = sorted(rails[:transport.active(rails)], key=lambda rail: rail.inflight)
            rails = rails[:transport.spread(rails)]
        caps = transport.capabilities
        weights = [float(getattr(rail, "weight", 1.0)) for rail in rails]
        plan = plan_columns(xfer.extents, num_rails=len(rails), slice_size=caps.slice_size,
                            max_sge=caps.max_sge, max_wr_bytes=caps.max_wr_bytes,
                            remote_scatter=caps.remote_scatter, weights=weights,
                            min_split=caps.min_split)
        transfer_id = next(self._transfer_ids)  # fresh per attempt: counts never mix
        notify_pending = xfer.notify is not None and xfer.op is Op.WRITE
        works: list[Work] = []
        host = all(seg.device == "cpu" for seg in xfer.local_segments)
        if not host and not caps.device_memory:
            self._finish(xfer, NotSupportedError(
                f"{name} cannot move device memory", peer=xfer.peer.name, op=str(xfer.op),
                transport=name))
            return
        for wr in plan.requests:
            imm = None
            if wr.imm and xfer.op is Op.WRITE and xfer.notify is not None:
                imm = Immediate(transfer_id, plan.rails_used,
                                xfer.notify if notify_pending else None)
                notify_pending = False
            iov = self._iov(wr, xfer.local_segments) if host else None
            works.append(Work(next(self._wr_ids), xfer.op, wr.local, wr.remote, wr.nbytes,
                              imm, iov, xfer))
        items = [(rails[wr.rail], w) for wr, w in zip(plan.requests, works, strict=True)]
        with xfer.lock:
            stopped = xfer.stopping
            if stopped is None:
                xfer.handle.transport = name
                xfer.remaining = len(works)
                xfer.error = None
                xfer.started = time.monotonic()
                xfer.posted, xfer.posting = items, True
        if stopped is not None:
            self._finish(xfer, stopped)
            return
        self._post(xfer, items)

    @staticmethod
    def _iov(wr: WorkRequest, segments: list[Segment]) -> np.ndarray:
        """The (address, length) rows of a request's local pieces (pinned host memory)."""
        pieces = wr.pieces
        if pieces is None:
            pieces = Columns.from_pairs([(loc, loc) for loc in wr.local])
        elif pieces.iov is not None:  # laid out when its Blocks was built
            return pieces.iov
        if len(segments) == 1:
            return iovec_array(pieces.loff + segments[0].address, pieces.length)
        address = np.zeros(len(pieces), dtype=np.int64)
        for seg in segments:
            address[pieces.lseg == seg.id] = seg.address
        return iovec_array(pieces.loff + address, pieces.length)

    def _post(self, xfer: _Transfer, items: list[tuple[Rail, Work]]) -> None:
        """Posts ``items`` (already ``xfer.posted``, with ``xfer.posting`` set)."""
        try:
            for i, (rail, work) in enumerate(items):
                error = xfer.stopping
                if error is None:
                    try:
                        rail.post(work)
                        continue
                    except TransferError as exc:
                        error = exc
                for _, unposted in items[i:]:
                    self._on_complete(Completion(unposted, error))
                return
        finally:
            with xfer.lock:
                xfer.posting = False

    def _on_complete(self, done: Completion) -> None:
        xfer: _Transfer = done.work.context
        with xfer.lock:
            if done.error is not None:
                xfer.error = xfer.error or done.error
            else:
                xfer.handle._add_bytes(done.work.nbytes)
            xfer.remaining -= 1
            if xfer.remaining > 0:
                return
            error = xfer.error
            fallback = (error is not None and isinstance(error, _FALLBACK_ERRORS)
                        and len(xfer.transports) > 1 and not xfer.notifying
                        and not self._closed and xfer.stopping is None)
            if fallback:
                failed = xfer.transports.pop(0)
        if error is not None:
            if fallback:
                xfer.peer.demote(failed)
                self.stats[f"fallback_{failed}"] += 1
                log.info("transfer %d to %s: %s failed (%s); retrying over %s",
                         xfer.handle.id, xfer.peer.name, failed, error, xfer.transports[0])
                xfer.handle._bytes_done = 0
                self._start_attempt(xfer)
                return
            self._finish(xfer, error)
            return
        if xfer.op is Op.READ and xfer.notify is not None and not xfer.notifying:
            xfer.notifying = True
            name = xfer.transports[0]
            work = Work(next(self._wr_ids), Op.WRITE, [], [], 0,
                        Immediate(next(self._transfer_ids), 1, xfer.notify), None, xfer)
            rails = xfer.peer.rails[name]
            items = [(next((r for r in rails if not r.closed), rails[0]), work)]
            with xfer.lock:
                xfer.remaining = 1
                xfer.posted, xfer.posting = items, True
            self._post(xfer, items)
            return
        self._finish(xfer, None)

    def _finish(self, xfer: _Transfer, error: TransferError | None) -> None:
        with xfer.lock:  # once: a closing engine may race a late completion here
            if xfer.finished:
                return
            xfer.finished = True
            if error is not None and xfer.stopping is not None:
                error = xfer.stopping  # the cancel said why, whatever failed after it
            segments, xfer.local_segments = xfer.local_segments, []
        for seg in segments:
            seg.unpin()
        with self._lock:
            self._live.pop(xfer.handle.id, None)
            retire = (xfer.peer in self._retired
                      and not any(x.peer is xfer.peer for x in self._live.values()))
            if retire:
                self._retired.discard(xfer.peer)
        if retire:
            xfer.peer.close()
        self.stats["transfers_failed" if error else "transfers_done"] += 1
        if error is None:
            self.stats[_BYTES_STAT[xfer.op]] += xfer.handle.nbytes
            if xfer.transports:
                xfer.peer.succeeded(xfer.transports[0], time.monotonic() - xfer.started)
        xfer.handle._finish(error)

    # --- stopping transfers: cancel, deadlines, stuck segments, silent peers ----------

    def _cancel_handle(self, handle: TransferHandle, error: TransferError) -> bool:
        with self._lock:
            xfer = self._live.get(handle.id)
        return xfer is not None and self._cancel(xfer, error)

    def _cancel(self, xfer: _Transfer, error: TransferError) -> bool:
        """Fails ``xfer`` with ``error`` once nothing of ours touches its memory: work
        not yet sent is withdrawn, rails with its work on the wire are torn down (their
        other work fails with ``PeerLostError``, which may fail over). False if it had
        finished or was being stopped already."""
        with xfer.lock:
            if xfer.finished or xfer.stopping is not None:
                return False
            xfer.stopping = error
            xfer.error = error
            del xfer.transports[1:]  # no fallback
            items = list(xfer.posted or ())
            posting = xfer.posting
        self.stats["transfers_timed_out" if isinstance(error, TransferTimeout)
                   else "transfers_cancelled"] += 1
        by_rail: dict[int, tuple[Rail, list[Work]]] = {}
        for rail, work in items:
            by_rail.setdefault(id(rail), (rail, []))[1].append(work)
        for rail, works in by_rail.values():
            if not posting:  # while posting, which work a rail holds is not settled
                taken, busy = rail.withdraw(works)
                for work in taken:
                    self._on_complete(Completion(work, error))
                if not busy:
                    continue
            self.stats["rails_torn_down"] += 1
            log.info("tearing down a %s rail to %s to stop transfer %d (%s)",
                     xfer.handle.transport, xfer.peer.name, xfer.handle.id, error.message)
            rail.abort(PeerLostError(
                f"rail torn down to stop transfer {xfer.handle.id} ({error.message})",
                peer=xfer.peer.name, transport=xfer.handle.transport))
        return True

    def _segment_stuck(self, seg: Segment) -> None:
        """``Segment.close`` found pins left after its wait: stop our transfers that use
        the segment, and have every transport tear down peers' requests on it."""
        with self._lock:
            live = [x for x in self._live.values()
                    if any(s is seg for s in x.local_segments)]
        for xfer in live:
            self._cancel(xfer, ClosedError("segment deregistered while the transfer used it",
                                           peer=xfer.peer.name, op=str(xfer.op),
                                           segment=seg.name))
        for transport in self._transports.values():
            try:
                transport.revoke(seg)
            except Exception:
                log.exception("%s could not revoke segment %s", transport.name, seg.name)

    def _start_watchdog(self) -> Watchdog | None:
        with self._lock:
            if self._watchdog is None and not self._closed:
                self._watchdog = Watchdog(self.name, self._zctx, self._signer,
                                          expire=self._expire, live=self._live,
                                          stuck=self._stuck, silent=self._silent,
                                          peer_timeout=self.peer_timeout)
            return self._watchdog

    def _expire(self, handle_id: int, seconds: float) -> None:
        with self._lock:
            xfer = self._live.get(handle_id)
        if xfer is not None:
            self._cancel(xfer, TransferTimeout(
                f"transfer {handle_id} not finished within its deadline of {seconds}s",
                peer=xfer.peer.name, op=str(xfer.op), transport=xfer.handle.transport,
                length=xfer.handle.nbytes))

    def _stuck(self, before: float) -> dict[Any, str]:
        """Peers with a transfer in flight since before ``before``, and where to probe
        them (their control endpoint)."""
        with self._lock:
            live = list(self._live.values())
        out: dict[Any, str] = {}
        for xfer in live:
            peer = xfer.peer
            if (0 < xfer.started < before and not xfer.finished and peer.lost is None
                    and peer not in out):
                out[peer] = peer.control_address
        return out

    def _silent(self, peer: Peer, seconds: float) -> None:
        with self._lock:
            current = self._peers.get(peer.name) is peer
        if current:
            self.peer_lost(peer.name, f"no answer to control probes for {seconds:.1f}s")

    # --- notifications ----------------------------------------------------------------

    def notifications(self, timeout: float | None = 0.0, max_count: int | None = None
                      ) -> list[Notification]:
        """Returns the notifications received so far (waiting up to ``timeout`` seconds
        for the first one; ``None`` waits without bound)."""
        with self._notes_cond:
            if not self._notes and timeout != 0:
                self._notes_cond.wait_for(lambda: bool(self._notes) or self._closed, timeout)
            out: list[Notification] = []
            while self._notes and (max_count is None or len(out) < max_count):
                out.append(self._notes.popleft())
            return out

    def on_notify(self, callback: Callable[[Notification], None]) -> None:
        """Calls ``callback(notification)`` from a transport thread for each one (they
        are also kept for :meth:`notifications`)."""
        with self._lock:
            self._callbacks.append(callback)

    # --- life cycle -------------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ClosedError("engine is closed", op=op)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Fails the transfers in flight with :class:`ClosedError`, then closes peers,
        transports, segments and the control endpoint. Idempotent.

        Transfers go first whatever the order things were made in: a segment waits for
        the transfers that use it, and those finish only once their rails are closed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._notes_cond.notify_all()
            peers = list(self._peers.values())
        try:
            if self._watchdog is not None:
                self._watchdog.close()
            for peer in peers:  # their rails fail the work they hold with ClosedError
                peer.close()
            with self._lock:
                live = list(self._live.values())
            for xfer in live:
                self._finish(xfer, ClosedError("engine closed", peer=xfer.peer.name,
                                               op=str(xfer.op)))
        finally:
            self._stack.close()

    def _unclosed(self) -> str:
        return f"Engine {self.name!r} was not closed"

    def __repr__(self) -> str:
        state = " CLOSED" if self._closed else ""
        return (f"<Engine {self.name!r} transports=[{','.join(self._transports)}] "
                f"peers={len(self._peers)} segments={len(self._segments)}{state}>")
