"""The registry client an engine uses: register, heartbeats, leave, lookup, list, events.

Threads and sockets: requests made by the caller (register, leave, lookup, list) go over
one DEALER, one at a time, bounded by ``timeout``. A background thread
``te-registry-<name>`` owns two more DEALERs: one sends heartbeats (and registers again
when the registry says it does not know us), the other long-polls ``Watch``. Events are
handed to callbacks by a third thread ``te-registry-events-<name>`` so that a slow
callback never delays a heartbeat.

Why a long poll and not PUB/SUB: a SUB socket silently drops what was published while it
was disconnected (slow joiner, registry restart) and a publisher cannot tell who missed
what. With sequence-numbered events the client asks for "everything after seq N" and
gets either exactly that or, if it fell behind or the registry restarted (new epoch), a
snapshot that it diffs against its view, so no join or leave is ever lost or invented.
Each poll is an ordinary signed request, so the same authentication covers events, and
it is answered the moment an event exists, so latency matches a PUB socket's.

Ownership: the client makes a random owner token that only it and the registry know; it
goes with every registration, heartbeat and leave, so no one else can remove, replace or
keep alive our name (the public ``incarnation`` cannot prove that: every peer that
handshakes with us learns it). Paging: a list and a watch snapshot arrive in pages cut
under the message size limit; :meth:`RegistryClient.list` and the watch follow them, so
callers see every member however many there are.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from transfer_engine import interrupts
from transfer_engine.control.auth import OVERHEAD, AuthConfig
from transfer_engine.control.messages import (
    MAX_MESSAGE_BYTES,
    Ack,
    ErrorReply,
    Events,
    Heartbeat,
    HeartbeatAck,
    Leave,
    ListMembers,
    Lookup,
    Members,
    Message,
    Registered,
    Watch,
)
from transfer_engine.control.metastore import (
    EventCallback,
    EventKind,
    MemberEvent,
    MemberRecord,
    MetadataStore,
    Subscription,
)
from transfer_engine.control.request import SignedClient
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
    UnknownPeerError,
)

__all__ = ["RegistryClient"]

log = logging.getLogger(__name__)

_MAX_REPLY = MAX_MESSAGE_BYTES + OVERHEAD + 4096  # one page: replies are paged
_MAX_MEMBERS = 1_000_000  # records a list or a snapshot may bring, across its pages


@dataclass
class _WatchState:
    """Where the watch stands: the last seq applied in ``epoch``, and while a paged
    snapshot arrives, the records so far and the cursor of the next page."""

    since: int = -1
    epoch: str = ""
    after: str = ""  # next snapshot page to ask for ("" : none pending)
    snapshot: dict[str, MemberRecord] | None = None
    complete: bool = True

    def reset(self) -> None:
        self.since, self.epoch, self.after, self.snapshot = -1, "", "", None


class RegistryClient:
    """A member's connection to a :class:`~transfer_engine.control.registry.Registry`.

    :param address: the registry endpoint, e.g. ``tcp://10.0.0.1:7100``.
    :param auth: signing of control messages; must match the registry's.
    :param timeout: seconds each request may take (and how long a heartbeat may go
        unanswered before its socket is reset).
    :param name: for thread names and logs.
    :param watch_wait: seconds a long poll stays parked at the registry.
    """

    def __init__(self, address: str, *, auth: AuthConfig | None = None,
                 timeout: float = 5.0, name: str = "client", watch_wait: float = 1.0) -> None:
        self.address = address
        self.name = name
        self.timeout = timeout
        self.watch_wait = watch_wait
        self.interval = 1.0  # told by the registry on registration
        self.max_missed = 3
        self.epoch = ""
        self.stats = collections.Counter[str]()
        self._signer = (auth or AuthConfig()).signer()
        self._token = secrets.token_hex(16)  # proves we own our name; never published
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._lock = threading.Lock()
        self._req = self._link()
        self._record: MemberRecord | None = None
        self._dirty = False  # our record must be (re)sent
        self._last_contact = 0.0  # when our record or a heartbeat was last sent
        self._callbacks: dict[int, EventCallback] = {}
        self._ids = itertools.count(1)
        self._view: dict[str, MemberRecord] = {}
        self._events: queue.SimpleQueue[tuple[int | None, MemberEvent] | None] = (
            queue.SimpleQueue())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dispatcher: threading.Thread | None = None
        self._closed = False

    def _link(self) -> SignedClient:
        """A DEALER to the registry (one for requests, one for heartbeats, one for the
        watch: a long poll parked at the registry must not hold up a heartbeat)."""
        address = self.address

        def timed_out(op: str, timeout: float) -> Exception:
            return TransferTimeout(f"registry {address} did not answer in {timeout}s",
                                   peer="registry", op=op)

        return SignedClient(self._ctx, address, self._signer, peer="registry",
                            name="registry client", what="registry", max_bytes=_MAX_REPLY,
                            reconnect=(50, 1000), timeout_error=timed_out)

    # --- requests ---------------------------------------------------------------------

    def _request(self, msg: Message, timeout: float | None) -> Message:
        if self._closed:
            raise ClosedError("registry client is closed", peer="registry", op=msg.kind)
        return self._req.request(msg, self.timeout if timeout is None else timeout)

    def register(self, record: MemberRecord, timeout: float | None = None) -> None:
        """Joins (or updates our record), then heartbeats from a background thread until
        :meth:`leave` or :meth:`close`. Raises ``ConnectError`` if refused,
        ``AuthenticationError`` on a secret mismatch, ``TransferTimeout``."""
        try:
            reply = self._request(record.to_message(self._token), timeout)
        except RemoteError as exc:
            raise ConnectError(exc.message, peer="registry", op="register") from exc
        if not isinstance(reply, Registered):
            raise ProtocolError(f"expected registered, got {reply.kind}", peer="registry")
        with self._lock:
            self.interval, self.max_missed = float(reply.interval), int(reply.max_missed)
            self.epoch = reply.epoch
            self._record = record
            self._dirty = False
            self._last_contact = time.monotonic()
        self._ensure_thread()

    def update(self, record: MemberRecord) -> None:
        """Replaces our record; sent by the background thread (does not block)."""
        with self._lock:
            if self._record is not None:
                self._record = record
                self._dirty = True

    def leave(self, timeout: float | None = None) -> None:
        """Stops heartbeats and removes our record. Idempotent."""
        with self._lock:
            record, self._record = self._record, None
        if record is not None and not self._closed:
            reply = self._request(Leave(record.name, record.incarnation, self._token),
                                  timeout)
            if not isinstance(reply, Ack):
                raise ProtocolError(f"expected ack, got {reply.kind}", peer="registry")

    def lookup(self, name: str, timeout: float | None = None) -> MemberRecord:
        reply = self._request(Lookup(name), timeout)
        if not isinstance(reply, Members):
            raise ProtocolError(f"expected members, got {reply.kind}", peer="registry")
        if not reply.members:
            raise UnknownPeerError("no member of that name in the registry", peer=name,
                                   op="lookup")
        return MemberRecord.from_wire(reply.members[0], peer="registry")

    def list(self, role: str | None = None, timeout: float | None = None
             ) -> list[MemberRecord]:
        """Every member (of ``role``), sorted by name, fetched page by page; ``timeout``
        bounds each page. A member present throughout is listed exactly once; one that
        joins or leaves meanwhile may or may not be."""
        records: list[MemberRecord] = []
        after = ""
        while True:
            reply = self._request(ListMembers(role or "", after), timeout)
            if not isinstance(reply, Members):
                raise ProtocolError(f"expected members, got {reply.kind}", peer="registry")
            records.extend(MemberRecord.from_wire(m, peer="registry") for m in reply.members)
            if not reply.next:
                return sorted(records, key=lambda r: r.name)
            if reply.next <= after or len(records) > _MAX_MEMBERS:
                raise ProtocolError(f"registry list pages do not end (cursor {reply.next!r} "
                                    f"after {after!r}, {len(records)} records)",
                                    peer="registry", op="list")
            after = reply.next

    # --- events -----------------------------------------------------------------------

    def watch(self, callback: EventCallback) -> Subscription:
        """Calls ``callback(MemberEvent)`` from the events thread: first a ``JOIN`` for
        every member already known, then each change."""
        if self._closed:
            raise ClosedError("registry client is closed", peer="registry", op="watch")
        with self._lock:
            cid = next(self._ids)
            self._callbacks[cid] = callback
            for record in self._view.values():
                self._events.put((cid, MemberEvent(EventKind.JOIN, record.name, record)))
        self._ensure_thread()

        def cancel() -> None:
            with self._lock:
                self._callbacks.pop(cid, None)
        return Subscription(cancel)

    @property
    def view(self) -> dict[str, MemberRecord]:
        """Members as the event stream has shown them so far."""
        with self._lock:
            return dict(self._view)

    def _dispatch(self) -> None:
        while True:
            item = self._events.get()
            if item is None:
                return
            target, event = item
            with self._lock:
                callbacks = ([self._callbacks[target]] if target in self._callbacks else []
                             ) if target is not None else list(self._callbacks.values())
            for cb in callbacks:
                try:
                    cb(event)
                except Exception:
                    log.exception("registry event callback failed")

    def _emit(self, event: MemberEvent) -> None:
        self.stats[f"event_{event.kind.value}"] += 1
        self._events.put((None, event))

    def _apply_snapshot(self, fresh: dict[str, MemberRecord], complete: bool) -> None:
        """Diffs a whole snapshot (all its pages) against the view."""
        with self._lock:
            for record in fresh.values():
                self._upsert(record)
            if complete:
                for name in [n for n in self._view if n not in fresh]:
                    del self._view[name]
                    self._emit(MemberEvent(EventKind.LEAVE, name,
                                           reason="absent from the registry"))

    def _apply(self, reply: Events) -> bool:
        """Updates the view from a page of events; True when a full snapshot is needed."""
        resync = False
        with self._lock:
            for ev in reply.events:
                kind, name = ev.get("type"), ev.get("name", "")
                if kind in ("join", "update"):
                    self._upsert(MemberRecord.from_wire(ev.get("member"), peer="registry"))
                elif kind in ("leave", "expire") and isinstance(name, str):
                    if self._view.pop(name, None) is not None:
                        self._emit(MemberEvent(EventKind(kind), name,
                                               reason=str(ev.get("reason", ""))))
                elif kind == "resync":
                    resync = True
        return resync

    def _upsert(self, record: MemberRecord) -> None:
        old = self._view.get(record.name)
        if old == record:
            return
        self._view[record.name] = record
        same = old is not None and old.incarnation == record.incarnation
        self._emit(MemberEvent(EventKind.UPDATE if same else EventKind.JOIN, record.name,
                               record))

    # --- background thread ------------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                name=f"te-registry-events-{self.name}")
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"te-registry-{self.name}")
            self._dispatcher.start()
            self._thread.start()

    def _run(self) -> None:
        hb: SignedClient | None = None
        watch: SignedClient | None = None
        hb_sent: tuple[float, bool] | None = None  # (when, was a registration)
        watch_deadline: float | None = None
        retry_at = 0.0
        state = _WatchState()
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    record, dirty, watching = self._record, self._dirty, bool(self._callbacks)
                    next_hb = self._last_contact + self.interval
                if record is not None and hb is None:
                    hb = self._link()
                    poller.register(hb.socket, zmq.POLLIN)
                if (record is not None and hb is not None and hb_sent is None
                        and (now >= next_hb or (dirty and now >= retry_at))):
                    msg: Message = (record.to_message(self._token) if dirty else
                                    Heartbeat(record.name, record.incarnation, self._token))
                    hb.send(msg)
                    hb_sent = (now, dirty)
                    with self._lock:
                        self._dirty = False
                        self._last_contact = now
                if hb_sent is not None and now - hb_sent[0] > min(
                        self.timeout, self.interval * self.max_missed):
                    self.stats["heartbeat_unanswered"] += 1
                    assert hb is not None
                    poller.unregister(hb.socket)
                    hb.close()
                    hb = None
                    if hb_sent[1]:
                        with self._lock:
                            self._dirty = self._record is not None
                    hb_sent = None
                if watching and watch is None:
                    watch = self._link()
                    poller.register(watch.socket, zmq.POLLIN)
                if watching and watch is not None and watch_deadline is None:
                    watch.send(Watch(state.epoch, state.since, self.watch_wait, state.after))
                    watch_deadline = now + self.watch_wait + self.timeout
                if watch is not None and watch_deadline is not None and now > watch_deadline:
                    self.stats["watch_unanswered"] += 1
                    poller.unregister(watch.socket)
                    watch.close()
                    watch, watch_deadline = None, None
                wait_ms = 50 if hb_sent or record is None else max(
                    1, min(50, int((next_hb - now) * 1000)))
                ready = dict(poller.poll(wait_ms)) if (hb or watch) else {}
                if not ready and not (hb or watch):
                    self._stop.wait(0.05)
                if hb is not None and hb.socket in ready:
                    hb_sent = None
                    retry_at, reset_watch = self._on_heartbeat_reply(hb, state.epoch)
                    if reset_watch and watch is not None:
                        poller.unregister(watch.socket)
                        watch.close()
                        watch, watch_deadline = None, None
                if watch is not None and watch.socket in ready:
                    watch_deadline = None
                    self._on_watch_reply(watch, state)
        except Exception:  # never leave a member silently unregistered without a trace
            log.exception("registry client %s: background thread failed", self.name)
        finally:
            for link in (hb, watch):
                if link is not None:
                    link.close()

    def _on_heartbeat_reply(self, hb: SignedClient, wepoch: str) -> tuple[float, bool]:
        """Takes the answer waiting on ``hb``; returns (when to retry a refused
        registration, whether to re-watch now)."""
        try:
            reply = hb.read("heartbeat")
        except TransferError as exc:
            self.stats["heartbeat_rejected"] += 1
            log.warning("registry client %s: bad heartbeat reply: %s", self.name, exc)
            return 0.0, False
        if isinstance(reply, Registered):
            self.stats["registered"] += 1
            with self._lock:
                self.interval, self.max_missed = float(reply.interval), int(reply.max_missed)
                self.epoch = reply.epoch
            return 0.0, bool(wepoch) and reply.epoch != wepoch
        if isinstance(reply, HeartbeatAck):
            self.stats["heartbeats"] += 1
            if not reply.known:
                self.stats["forgotten"] += 1
                log.info("registry client %s: registry does not know us; registering again",
                         self.name)
                with self._lock:
                    self._dirty = self._record is not None
            return 0.0, bool(wepoch) and reply.epoch != wepoch
        if isinstance(reply, ErrorReply):
            self.stats["register_refused"] += 1
            log.warning("registry client %s: registration refused: %s", self.name,
                        reply.message)
            with self._lock:
                self._dirty = self._record is not None
            return time.monotonic() + self.interval, False
        return 0.0, False

    def _on_watch_reply(self, watch: SignedClient, state: _WatchState) -> None:
        """Applies the watch answer waiting on ``watch`` and moves ``state`` on: to the
        next events, or to the next page of a snapshot (applied once its last page is
        in)."""
        try:
            reply = watch.read("watch")
            if isinstance(reply, ErrorReply):
                raise RemoteError(reply.message, peer="registry", op="watch")
            if not isinstance(reply, Events):
                raise ProtocolError(f"expected events, got {reply.kind}", peer="registry")
            if reply.snapshot:
                self._snapshot_page(reply, state)
                return
            resync = self._apply(reply)
        except TransferError as exc:
            self.stats["watch_rejected"] += 1
            log.warning("registry client %s: watch failed: %s; resyncing", self.name, exc)
            time.sleep(0.05)  # bounded back-off against a registry that keeps refusing
            state.reset()
            return
        state.since, state.epoch, state.after, state.snapshot = (
            -1 if resync else reply.seq), reply.epoch, "", None

    def _snapshot_page(self, reply: Events, state: _WatchState) -> None:
        if not reply.after:  # a first page: (re)start collecting
            state.snapshot, state.complete = {}, True
            state.since, state.epoch = reply.seq, reply.epoch
        elif (state.snapshot is None or reply.after != state.after
              or reply.epoch != state.epoch):
            raise ProtocolError(f"snapshot page after {reply.after!r} out of order",
                                peer="registry", op="watch")
        snapshot = state.snapshot
        assert snapshot is not None
        for wire in reply.members:
            record = MemberRecord.from_wire(wire, peer="registry")
            snapshot[record.name] = record
        state.complete = state.complete and reply.complete
        if reply.next:
            if reply.next <= reply.after or len(snapshot) > _MAX_MEMBERS:
                raise ProtocolError(f"snapshot pages do not end (cursor {reply.next!r} after "
                                    f"{reply.after!r}, {len(snapshot)} records)",
                                    peer="registry", op="watch")
            state.after = reply.next
            return
        self.stats["snapshots"] += 1
        self._apply_snapshot(snapshot, state.complete)
        state.after, state.snapshot = "", None

    # --- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        """Stops the threads and closes the sockets (does not leave: call
        :meth:`leave` first for a prompt goodbye). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._events.put(None)
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(5)
        self._req.close()
        interrupts.term(self._ctx)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("MEMBER" if self._record else "CLIENT")
        return (f"<RegistryClient {self.name!r} -> {self.address} {state} "
                f"view={len(self._view)}>")


class RegistryStore(MetadataStore):
    """The embedded :class:`MetadataStore`: a :class:`RegistryClient` to a ZeroMQ
    :class:`~transfer_engine.control.registry.Registry`.

    :param address: the registry's endpoint (``tcp://host:port``).
    :param auth: how control messages are signed (see :mod:`.auth`); ``None``: unsigned.
    :param timeout: seconds for each registry request.
    :param name: used in thread names and logs.
    """

    def __init__(self, address: str, *, auth: Any = None, timeout: float = 5.0,
                 name: str = "client") -> None:
        self.client = RegistryClient(address, auth=auth, timeout=timeout, name=name)

    def put(self, record: MemberRecord, timeout: float | None = None) -> None:
        self.client.register(record, timeout)

    def get(self, name: str, timeout: float | None = None) -> MemberRecord:
        return self.client.lookup(name, timeout)

    def delete(self, name: str, timeout: float | None = None) -> None:
        self.client.leave(timeout)

    def list(self, role: str | None = None, timeout: float | None = None
             ) -> list[MemberRecord]:
        return self.client.list(role, timeout)

    def watch(self, callback: EventCallback) -> Subscription:
        return self.client.watch(callback)

    def publish(self, record: MemberRecord) -> None:
        self.client.update(record)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"<RegistryStore {self.client!r}>"
