"""The Engine: one per process; owns transports, segments, peers and transfers.

    with Engine("decode-0") as engine:                      # control endpoint + transports
        seg = engine.register(kv_tensor)                    # a Segment (context manager)
        peer = engine.connect("tcp://10.0.0.5:7000")        # peer-to-peer handshake
        dst = peer.segment("kv")
        h = engine.write(peer, [(Descriptor(seg, 0, n), Descriptor(dst, 0, n))],
                         notify=b"req-17")
        h.wait(timeout=5)

The engine is the facade: it owns the transports, the segments and the notifications
and puts together its parts, one module each (they share the state named in
:mod:`~transfer_engine.state`):

- :mod:`~transfer_engine.transfer`: transfers in flight (submit, plan, post, complete,
  fall back, cancel, deadlines), checked first by :mod:`~transfer_engine.validate`;
- :mod:`~transfer_engine.peers`: one connection per peer, made by the handshake;
- :mod:`~transfer_engine.membership`: what the engine does with a registry;
- :mod:`~transfer_engine.endpoint`: the control endpoint that answers handshakes.

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
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import numpy as np

from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig, check_exposure
from transfer_engine.control.metastore import MetadataStore
from transfer_engine.control.tickets import Ticket, TicketBook, check_name
from transfer_engine.endpoint import ControlEndpoint
from transfer_engine.errors import (
    ClosedError,
    InvalidDescriptorError,
    NotSupportedError,
    TransferEngineError,
)
from transfer_engine.interrupts import Deferred
from transfer_engine.latency import Latencies
from transfer_engine.membership import Membership
from transfer_engine.notify import ImmediateCounter, KeptNotes, Notification
from transfer_engine.peer import Peer
from transfer_engine.peers import Peers
from transfer_engine.segment import Segment, describe_memory
from transfer_engine.staging import Staging
from transfer_engine.state import LiveTransfer, TrafficPolicy
from transfer_engine.transfer import Transfers
from transfer_engine.transport import held, load_transport
from transfer_engine.transport.base import Immediate, Transport
from transfer_engine.transport.shm import host_id
from transfer_engine.transport.stream.process import serve_mode
from transfer_engine.validate import Pairs
from transfer_engine.watchdog import Watchdog

__all__ = ["Engine", "Pairs"]

log = logging.getLogger(__name__)

DEFAULT_TRANSPORTS = ("shm", "rdma", "tcp")  # best first; missing ones are skipped
KEPT_NOTES = 65536  # notifications kept for Engine.notifications() at most
KEPT_NOTE_BYTES = 64 << 20  # and their payload bytes


class Engine(Transfers, Peers, Membership, ControlEndpoint, Closeable):
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
        :mod:`transfer_engine.control.registry`), an etcd address
        (``etcd://host:port[/prefix]``, see :mod:`transfer_engine.control.etcd_store`)
        or any
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
    :param traffic: a :class:`~transfer_engine.state.TrafficPolicy` that orders the
        transports of each transfer (e.g. ``scheduler.policy.TrafficPolicy``) and hears
        how each went; ``None``: the peer's health order alone.
    :param serve: where the tcp and shm transports this engine loads by name serve
        peers' requests: ``"thread"``, or ``"process"`` (a serving process, for an
        application whose threads are busy in Python; see docs/data-plane.md). ``None``:
        ``$TE_SERVE``, else threads. Transport objects passed in keep their own.
    :param hold_gil: seconds a thread may wait for its transfer's peer holding the GIL
        (a busy Python thread then costs no hand-off; docs/data-plane.md). ``None``:
        ``$TE_HOLD_GIL``, else the switch interval; 0: never.
    """

    _watchdog: Watchdog | None = None  # started with the first transfer
    _staging_area: Staging | None = None  # bounces for device memory, made on first need

    def __init__(self, name: str, *, host: str = "127.0.0.1", port: int = 0,
                 transports: Sequence[str | Transport] | None = None,
                 timeout: float = 10.0, registry: str | MetadataStore | None = None,
                 role: str = "any", pod: str = "", zone: str = "",
                 auth: AuthConfig | str | bytes | None = None,
                 insecure: bool | None = None,
                 transfer_timeout: float | None = None,
                 peer_timeout: float | None = 10.0,
                 traffic: TrafficPolicy | None = None,
                 serve: str | None = None, hold_gil: float | None = None) -> None:
        self.serve = None if serve is None else serve_mode(serve)  # checked here, once
        self.hold_gil = held.budget(hold_gil)
        self.name = check_name(name)
        self.traffic = traffic
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
        self._live: dict[int, LiveTransfer] = {}
        self._by_address: dict[str, Peer] = {}  # control endpoint -> its peer
        self._connecting: dict[str, Future[Peer]] = {}  # handshakes under way
        self._retired: set[Peer] = set()  # replaced, closed when their transfers end
        self._counter = ImmediateCounter()
        self._notes = KeptNotes(KEPT_NOTES, KEPT_NOTE_BYTES)
        self._notes_cond = threading.Condition(self._lock)
        self._callbacks: list[Callable[[Notification], None]] = []
        self.stats = collections.Counter[str]()
        self.latencies = Latencies()  # finished transfers', for transfer_engine.metrics
        self.incarnation = uuid.uuid4().hex[:16]
        self.role, self.pod, self.zone = role, pod, zone
        self._placement = {"name": name, "host_id": self.host_id, "pod": pod, "zone": zone}
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
                    kwargs: dict[str, Any] = (
                        {"host": self.host} if spec in ("tcp", "rdma") else {})
                    if self.serve is not None and spec in ("tcp", "shm"):
                        kwargs["serve"] = self.serve
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

    def deliver_immediate(self, peer: str, imm: Immediate, origin: bytes = b"",
                          work: int | None = None, resent: bool = False) -> None:
        with self._lock:
            duplicates = self._counter.duplicates
            try:
                note = self._counter.arrive(peer, imm.transfer_id, imm.expected, imm.notify,
                                            origin, work, resent, imm.first)
                if self._counter.duplicates != duplicates:
                    self.stats["notify_duplicates"] += 1  # a work or attempt again
            except ValueError as exc:
                log.warning("bad immediate from %s: %s", peer, exc)
                return
            if note is None:
                return
            self.stats["notifications_dropped"] += self._notes.append(note)
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

    def metadata(self) -> dict[str, Any]:
        with self._lock:
            segments = [s.to_wire() for s in self._segments.values() if not s.closed]
        return {"name": self.name, "host_id": self.host_id, "hostname": socket.gethostname(),
                "pid": os.getpid(), "control": self.endpoint,
                "incarnation": self.incarnation, "pod": self.pod, "zone": self.zone,
                "transports": dict(self._transport_info), "segments": segments}

    # --- segments ---------------------------------------------------------------------

    def register(self, obj: Any, name: str | None = None) -> Segment:
        """Registers memory so that peers can reach it; returns a :class:`Segment` that
        deregisters on ``close()`` (or at the end of a ``with`` block).

        ``obj``: a CPU torch tensor, a numpy array, a writable buffer (bytearray,
        memoryview, mmap), a CUDA tensor or array, or a raw ``(address, length)``
        tuple (``(address, length, "cuda:N")`` for device memory; the caller keeps that
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

    @property
    def transports(self) -> dict[str, Transport]:
        """The transports this engine started, by name, best first (a copy)."""
        return dict(self._transports)

    # --- notifications ----------------------------------------------------------------

    def notifications(self, timeout: float | None = 0.0, max_count: int | None = None
                      ) -> list[Notification]:
        """Returns the notifications received so far (waiting up to ``timeout`` seconds
        for the first one; ``None`` waits without bound)."""
        with self._notes_cond:
            if not self._notes and timeout != 0:
                self._notes_cond.wait_for(lambda: bool(self._notes) or self._closed, timeout)
            return self._notes.take(max_count)

    def on_notify(self, callback: Callable[[Notification], None]) -> None:
        """Calls ``callback(notification)`` from a transport thread for each one (they
        are also kept for :meth:`notifications`: the latest ``KEPT_NOTES``, up to
        ``KEPT_NOTE_BYTES`` of payload; older ones are dropped, counted in
        ``stats["notifications_dropped"]``)."""
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
        transports, segments and the control endpoint. Idempotent. Transfers go first
        whatever the order things were made in: a segment waits for the transfers that
        use it, and those finish only once their rails are closed."""
        with Deferred():  # a close cut short by Ctrl-C could not be done again
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
                if self._staging_area is not None:
                    self._staging_area.close()
            finally:
                self._stack.close()

    def _unclosed(self) -> str:
        return f"Engine {self.name!r} was not closed"

    def __repr__(self) -> str:
        state = " CLOSED" if self._closed else ""
        return (f"<Engine {self.name!r} transports=[{','.join(self._transports)}] "
                f"peers={len(self._peers)} segments={len(self._segments)}{state}>")
