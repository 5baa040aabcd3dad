"""The membership registry: one ZeroMQ ROUTER socket, one thread, msgpack messages.

Protocol (each request gets exactly one reply on the same DEALER):

- ``Register(record, token)`` -> ``Registered(epoch, interval, max_missed)``: join, or
  update the record. ``token`` is the registering client's secret: a name is owned by
  the token that registered it, and only that token may update it, keep it alive or
  remove it. A name held by another live owner is refused (``ErrorReply``) until that
  one leaves or expires. The token is kept only as a hash and never published; the
  record's ``incarnation`` is public (peers compare it to notice a restart).
- ``Heartbeat(name, incarnation, token)`` -> ``HeartbeatAck(known, epoch)``; ``known``
  False tells the member to register again (registry restarted, or it was expired).
- ``Leave(name, incarnation, token)`` -> ``Ack``, or ``ErrorReply`` saying whose the
  name is when incarnation or token do not match.
- ``Lookup(name)`` -> ``Members``; ``ListMembers(role, after)`` -> ``Members(next)``:
  one page of members sorted by name, ``next`` the cursor of the following page.
- ``Watch(epoch, since, wait, after)`` -> ``Events``: a long poll, answered when an
  event after ``since`` exists (a page of them) or after ``wait`` seconds; a stale
  epoch or an evicted ``since`` gets a snapshot of every member, in pages.
- Anything unauthenticated -> ``Denied``; malformed, wrong-version or oversized ->
  ``ErrorReply`` with the reason (also logged, rate-limited). Nothing a client sends can
  stop the loop.

What an outsider can make it hold is bounded (:class:`RegistryLimits`): members and
their bytes (new names are refused beyond them; existing members keep working), the
event log in events and bytes (a watcher that falls behind gets a snapshot), parked
watches, and registrations per source address (a token bucket keyed by the address the
kernel reports, so new connections do not refill it). Without a control secret it
serves only loopback unless the operator opts in (``allow_insecure`` /
``TE_ALLOW_INSECURE=1``).

A member silent for ``max_missed`` heartbeat intervals is dropped with an ``expire``
event. A registry keeps no state on disk: after a restart it relearns its members from
their next heartbeats (``known`` False -> they register again). Until
``max_missed + 1`` intervals have passed, its snapshots say ``complete=False`` so that
watchers do not take an absent member for a departed one; then it logs a ``resync``
event and watchers fetch a complete snapshot.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from transfer_engine import interrupts
from transfer_engine.control.auth import OVERHEAD, AuthConfig, open_request
from transfer_engine.control.limits import RegistryLimits, SourceBuckets, check_bind
from transfer_engine.control.messages import (
    SMALL,
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
    Register,
    Registered,
    Watch,
    encode_packed,
)
from transfer_engine.control.metastore import ROLES, MemberRecord
from transfer_engine.control.reply import answer_multipart, refuse, send_reply
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ProtocolError,
    TransferError,
)

__all__ = ["Registry", "RegistryLimits"]

log = logging.getLogger(__name__)

_MAX_FRAME = Register.max_bytes + OVERHEAD + 4096  # libzmq drops larger frames outright
_SMALL_FRAME = SMALL + OVERHEAD  # anything larger can only be a registration
_MAX_WAIT = 30.0  # longest long poll
_TOKEN_CHARS = (16, 256)  # bounds of an owner token's length


@dataclass(slots=True)
class _Member:
    """A member as the registry keeps it: the published record only as its encoded
    bytes (decoding 128 segment maps per member into Python objects would cost ~15x
    the memory), plus what requests are checked against."""

    name: str
    incarnation: str
    role: str
    owner: bytes  # sha256 of the owner token: the token itself is kept nowhere
    packed: bytes  # msgpack of MemberRecord.to_wire(): what lookups and watches get
    last_seen: float


def _owner(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _packed_event(seq: int, kind: str, name: str, member: bytes | None,
                  reason: str) -> bytes:
    """The msgpack of ``{"seq", "type", "name", "member", "reason"}`` (see
    :class:`Events`), joined around the member's already encoded record."""
    pack = msgpack.packb
    return b"".join((b"\x85", pack("seq"), pack(seq), pack("type"), pack(kind),
                     pack("name"), pack(name), pack("member"),
                     member if member is not None else pack(None),
                     pack("reason"), pack(reason)))


class _RejectLog:
    """Logs rejected messages with their reason, at most ``per_second`` lines a second;
    the rest are counted and summed up in the next line."""

    def __init__(self, per_second: int = 10, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._per_second = per_second
        self._clock = clock
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def __call__(self, reason: str) -> None:
        now = self._clock()
        if now - self._window >= 1.0:
            if self._suppressed:
                log.warning("registry: %d more messages rejected", self._suppressed)
            self._window, self._count, self._suppressed = now, 0, 0
        if self._count < self._per_second:
            self._count += 1
            log.warning("registry: message rejected: %s", reason)
        else:
            self._suppressed += 1


class Registry:
    """The membership service; a context manager. ``start()`` binds and serves from a
    thread named ``te-registry``; ``close()`` stops it (idempotent).

    :param bind: ZeroMQ endpoint to bind (``tcp://127.0.0.1:0`` picks a free port; the
        bound one is ``self.endpoint``). Without a control secret only a loopback (or
        ipc) endpoint is accepted unless ``allow_insecure``; otherwise ``ValueError``.
    :param auth: signing of control messages; ``None``: accept unsigned ones.
    :param interval: heartbeat interval, seconds, that members are told to use.
    :param max_missed: silent intervals after which a member is dropped.
    :param limits: bounds on members, event memory, join rate and reply pages.
    :param allow_insecure: serve a network-reachable endpoint without a secret (logged
        as a warning); ``None``: as the environment variable ``TE_ALLOW_INSECURE`` says.
    :param clock: monotonic clock (seconds), injectable for tests.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, auth: AuthConfig | None = None,
                 interval: float = 1.0, max_missed: int = 3,
                 limits: RegistryLimits | None = None, allow_insecure: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0 or max_missed < 1:
            raise ValueError("interval must be positive and max_missed at least 1")
        self._signer = (auth or AuthConfig()).signer()
        check_bind(bind, self._signer is not None, allow_insecure)
        self.bind = bind
        self.interval = float(interval)
        self.max_missed = int(max_missed)
        self.limits = limits or RegistryLimits()
        self.epoch = uuid.uuid4().hex[:16]
        self.endpoint: str | None = None
        self.stats = Counter[str]()
        self._clock = clock
        self._members: dict[str, _Member] = {}
        self._names: list[str] = []  # sorted: pages are cut by name
        self._member_bytes = 0
        self._log: deque[tuple[int, bytes]] = deque()  # (seq, encoded event)
        self._log_bytes = 0
        self._seq = 0
        self._waiters: dict[bytes, tuple[int, float]] = {}  # ident -> (since, deadline)
        self._buckets = SourceBuckets(self.limits.join_rate, self.limits.join_burst,
                                      self.limits.max_sources, clock)
        self._recovering_until = 0.0
        self._next_expire = 0.0
        self._lock = threading.Lock()  # guards _members for readers outside the loop
        self._reject = _RejectLog(clock=clock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._closed = False

    # --- life cycle -------------------------------------------------------------------

    def start(self) -> Registry:
        if self._closed:
            raise ClosedError("registry is closed", op="start")
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            # replies queued per connection: a client that never reads holds at most
            # this many pages of page_bytes here (more are dropped)
            sock.setsockopt(zmq.SNDHWM, 1024)
            if self.bind.endswith(":0"):
                port = sock.bind_to_random_port(self.bind[:-2])
                self.endpoint = f"{self.bind[:-2]}:{port}"
            else:
                sock.bind(self.bind)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(0)
            interrupts.term(self._ctx)
            self._ctx = None
            raise
        self._sock = sock
        self._recovering_until = self._clock() + self.interval * (self.max_missed + 1)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="te-registry")
        self._thread.start()
        log.info("registry %s serving on %s (epoch %s)", self.bind, self.endpoint, self.epoch)
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            interrupts.term(self._ctx)

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def members(self) -> list[MemberRecord]:
        with self._lock:
            packed = [self._members[n].packed for n in self._names]
        return [MemberRecord.from_wire(msgpack.unpackb(p), peer="registry") for p in packed]

    @property
    def serving(self) -> bool:
        """Whether the registry's thread is up: started, not closed, not crashed."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def signed(self) -> bool:
        """Whether every message must be signed with the secret (``auth`` given)."""
        return self._signer is not None

    @property
    def event_bytes(self) -> int:
        """Encoded bytes the event log holds now (bounded by ``limits.log_bytes``)."""
        return self._log_bytes

    @property
    def event_count(self) -> int:
        return len(self._log)

    @property
    def member_bytes(self) -> int:
        """Encoded bytes of all member records (bounded by ``limits.max_member_bytes``)."""
        return self._member_bytes

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("SERVING" if self._thread else "NEW")
        return (f"<Registry {self.endpoint or self.bind} {state} "
                f"members={len(self._members)} seq={self._seq}>")

    # --- loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        resynced = False
        while not self._stop.is_set():
            try:
                ready = poller.poll(50)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            try:
                now = self._clock()
                if ready:
                    for _ in range(256):  # bounded batch, then housekeeping
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._serve(frames, now)
                        del frames  # a zmq.Frame left alive would block ctx.term()
                if now >= self._next_expire:
                    self._next_expire = now + self.interval / 8
                    self._expire(now)
                if not resynced and now >= self._recovering_until:
                    resynced = True
                    self._event("resync", "", None, "membership relearned")
                self._answer_waiters(now)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("registry socket error")
            except Exception:  # a bug must not stop the service
                log.exception("registry loop failed")

    def _send(self, ident: bytes, msg: Message | bytes) -> None:
        """Sends a reply: a message, or one already encoded (by ``encode_packed``)."""
        assert self._sock is not None
        if not send_reply(self._sock, ident, msg, self._signer):
            self.stats["reply_dropped"] += 1

    def _serve(self, frames: list[zmq.Frame], now: float) -> None:
        self.stats["requests"] += 1
        if len(frames) != 2:
            self.stats["rejected"] += 1
            self._reject(f"{len(frames)} frames (expected one)")
            assert self._sock is not None
            if not answer_multipart(self._sock, frames, self._signer):
                self.stats["reply_dropped"] += 1
            return
        ident, data = frames[0].bytes, frames[1].bytes
        charged = len(data) > _SMALL_FRAME  # only a registration is this large
        source = self._source(frames[1]) if charged else ""
        if charged and not self._buckets.take(source):
            # refused before its (up to 1 MiB) decoding or signature check costs anything
            self.stats["rejected"] += 1
            self._reject(self._rate_message(source))
            self._send(ident, ErrorReply(self._rate_message(source)))
            return
        try:
            msg = open_request(data, self._signer)
        except TransferError as exc:
            exc.with_context(peer=source or self._source(frames[1]))
            self._refuse(ident, exc)
            return
        if not source and isinstance(msg, Register):
            source = self._source(frames[1])
        try:
            reply = self._handle(ident, msg, source, charged, now)
        except TransferError as exc:
            self.stats["rejected"] += 1
            self._reject(f"{msg.kind} from {source or self._source(frames[1])}: "
                         f"{exc.message}")
            reply = ErrorReply(exc.message)
        if reply is not None:
            self._send(ident, reply)

    def _refuse(self, ident: bytes, exc: TransferError) -> None:
        """Answers a message that failed authentication or decoding."""
        self.stats["rejected"] += 1
        self._reject(str(exc))
        if isinstance(exc, AuthenticationError):
            self.stats["denied"] += 1
        assert self._sock is not None
        if not refuse(self._sock, ident, exc, self._signer):
            self.stats["reply_dropped"] += 1

    @staticmethod
    def _source(frame: zmq.Frame) -> str:
        """The sender's address (the rate limit's key): what the kernel says, never
        what the message claims."""
        try:
            return str(frame.get("Peer-Address"))
        except zmq.ZMQError:
            return "?"

    def _rate_message(self, source: str) -> str:
        return (f"too many registrations from {source}: at most {self.limits.join_burst} "
                f"at once, then {self.limits.join_rate:g} a second; retry later")

    def _handle(self, ident: bytes, msg: Message, source: str, charged: bool, now: float
                ) -> Message | bytes | None:
        if isinstance(msg, Heartbeat):
            self.stats["heartbeats"] += 1
            member = self._members.get(msg.name)
            known = (member is not None and member.incarnation == msg.incarnation
                     and hmac.compare_digest(member.owner, _owner(msg.token)))
            if member is not None and known:
                member.last_seen = now
            return HeartbeatAck(known, self.epoch)
        if isinstance(msg, Register):
            return self._register(msg, source, charged, now)
        if isinstance(msg, Leave):
            return self._leave(msg)
        if isinstance(msg, Lookup):
            member = self._members.get(msg.name)
            return encode_packed(Members(), members=[member.packed] if member else [])
        if isinstance(msg, ListMembers):
            if msg.role and msg.role not in ROLES:
                raise ProtocolError(f"role {msg.role!r} is not one of {ROLES}")
            page, after = self._page(msg.after, msg.role)
            return encode_packed(Members(next=after), members=page)
        if isinstance(msg, Watch):
            return self._watch(ident, msg, now)
        raise ProtocolError(f"unexpected {msg.kind} at the registry")

    # --- membership -------------------------------------------------------------------

    def _register(self, msg: Register, source: str, charged: bool, now: float) -> Message:
        record = MemberRecord.from_message(msg, peer=source)
        low, high = _TOKEN_CHARS
        if not low <= len(msg.token) <= high:
            raise ProtocolError(f"register of {record.name!r}: the owner token must have "
                                f"{low} to {high} characters (protocol 3 clients send one)")
        owner = _owner(msg.token)
        old = self._members.get(record.name)
        if old is not None and not hmac.compare_digest(old.owner, owner):
            self.stats["refused_owner"] += 1
            raise ProtocolError(
                f"name {record.name!r} is held by a live member (incarnation "
                f"{old.incarnation}) registered by another client; it is released when "
                f"that one leaves or after {self.interval * self.max_missed:g}s without "
                f"heartbeats")
        packed: bytes = msgpack.packb(record.to_wire())
        if old is not None and old.packed == packed:
            old.last_seen = now  # a re-send (lost reply): nothing changed
            return self._registered()
        limits = self.limits
        if old is None and len(self._members) >= limits.max_members:
            self.stats["refused_full"] += 1
            raise ProtocolError(f"registry full: {limits.max_members} members; "
                                f"{record.name!r} is not admitted until members leave")
        grow = len(packed) - (len(old.packed) if old is not None else 0)
        if grow > 0 and self._member_bytes + grow > limits.max_member_bytes:
            self.stats["refused_full"] += 1
            raise ProtocolError(f"registry full: member records would pass "
                                f"{limits.max_member_bytes} bytes; {record.name!r} "
                                f"({len(packed)} bytes) is not admitted")
        if not charged and not self._buckets.take(source):
            self.stats["rate_limited"] += 1
            raise ProtocolError(self._rate_message(source))
        member = _Member(record.name, record.incarnation, record.role, owner, packed, now)
        with self._lock:
            self._members[record.name] = member
            if old is None:
                bisect.insort(self._names, record.name)
            self._member_bytes += grow
        if old is None:
            self.stats["joins"] += 1
            self._event("join", record.name, packed, "registered")
        elif old.incarnation != record.incarnation:
            self._event("join", record.name, packed, "registered a new incarnation")
        else:
            self._event("update", record.name, packed, "metadata changed")
        return self._registered()

    def _registered(self) -> Registered:
        return Registered(self.epoch, self.interval, self.max_missed)

    def _leave(self, msg: Leave) -> Message:
        """Only the owner leaves: a name that is gone already is fine (idempotent), one
        held by another incarnation or client is refused, saying which."""
        member = self._members.get(msg.name)
        if member is None:
            return Ack()
        if member.incarnation != msg.incarnation:
            self.stats["refused_owner"] += 1
            raise ProtocolError(f"leave of {msg.name!r} refused: it is held by incarnation "
                                f"{member.incarnation}, not {msg.incarnation!r}")
        if not hmac.compare_digest(member.owner, _owner(msg.token)):
            self.stats["refused_owner"] += 1
            raise ProtocolError(f"leave of {msg.name!r} refused: the owner token does not "
                                f"match (only the client that registered it may leave)")
        self._drop(msg.name, "leave", "left")
        return Ack()

    def _drop(self, name: str, kind: str, reason: str) -> None:
        with self._lock:
            member = self._members.pop(name, None)
            if member is None:
                return
            del self._names[bisect.bisect_left(self._names, name)]
            self._member_bytes -= len(member.packed)
        self.stats[kind + "s"] += 1
        self._event(kind, name, None, reason)

    def _expire(self, now: float) -> None:
        limit = self.interval * self.max_missed
        for name in [n for n, m in self._members.items() if now - m.last_seen > limit]:
            log.info("registry: %s expired after %.1fs of silence", name, limit)
            self._drop(name, "expire", f"no heartbeat for {limit:g}s")

    def _page(self, after: str, role: str = "") -> tuple[list[bytes], str]:
        """Encoded records of members (of ``role``) named after ``after``, up to
        ``page_bytes`` (at least one); and the name to continue after ("" at the end)."""
        names, members, budget = self._names, self._members, self.limits.page_bytes
        page: list[bytes] = []
        size, last = 0, ""
        for i in range(bisect.bisect_right(names, after) if after else 0, len(names)):
            member = members[names[i]]
            if role and member.role != role:
                continue
            if page and size + len(member.packed) > budget:
                return page, last
            page.append(member.packed)
            size += len(member.packed)
            last = member.name
        return page, ""

    # --- events and watches -----------------------------------------------------------

    def _event(self, kind: str, name: str, member: bytes | None, reason: str) -> None:
        """Logs an event; the oldest ones go once the log passes its count or byte
        bound (their watchers then get a snapshot)."""
        self._seq += 1
        data = _packed_event(self._seq, kind, name, member, reason)
        self._log.append((self._seq, data))
        self._log_bytes += len(data)
        limits = self.limits
        while self._log and (len(self._log) > limits.log_events
                             or self._log_bytes > limits.log_bytes):
            self._log_bytes -= len(self._log.popleft()[1])
            self.stats["events_evicted"] += 1

    def _watch(self, ident: bytes, msg: Watch, now: float) -> Message | bytes | None:
        self.stats["watches"] += 1
        oldest = self._log[0][0] if self._log else self._seq + 1
        lost = msg.epoch != self.epoch or msg.since < 0 or msg.since < oldest - 1
        if msg.after:  # the next page of a snapshot taken at seq ``since``
            if lost or msg.since > self._seq:
                return self._snapshot("", self._seq, now)
            return self._snapshot(msg.after, msg.since, now)
        if lost:
            return self._snapshot("", self._seq, now)
        if msg.since > self._seq:
            raise ProtocolError(f"watch from seq {msg.since} beyond ours ({self._seq})")
        if msg.since < self._seq:
            return self._events_after(msg.since)
        if ident not in self._waiters and len(self._waiters) >= self.limits.max_waiters:
            self.stats["watch_not_parked"] += 1
            return Events(self.epoch, self._seq)  # answered at once: the client re-polls
        wait = min(max(float(msg.wait), 0.0), _MAX_WAIT)
        self._waiters[ident] = (msg.since, now + wait)
        return None

    def _snapshot(self, after: str, seq: int, now: float) -> bytes:
        page, following = self._page(after)
        return encode_packed(Events(self.epoch, seq, [], True, [],
                                    now >= self._recovering_until, after, following),
                             members=page)

    def _events_after(self, since: int) -> bytes:
        """The events after ``since`` (all still logged), up to a page; ``seq`` of the
        reply is the last one included, so the watcher asks again for the rest."""
        log_, budget = self._log, self.limits.page_bytes
        page: list[bytes] = []
        size, last = 0, since
        for i in range(since - log_[0][0] + 1, len(log_)):
            seq, data = log_[i]
            if page and size + len(data) > budget:
                break
            page.append(data)
            size += len(data)
            last = seq
        return encode_packed(Events(self.epoch, last), events=page)

    def _answer_waiters(self, now: float) -> None:
        if not self._waiters:
            return
        done = []
        for ident, (since, deadline) in self._waiters.items():
            if since < self._seq:
                oldest = self._log[0][0] if self._log else self._seq + 1
                self._send(ident, self._events_after(since) if since >= oldest - 1
                           else self._snapshot("", self._seq, now))
            elif now >= deadline:
                self._send(ident, Events(self.epoch, self._seq))
            else:
                continue
            done.append(ident)
        for ident in done:
            del self._waiters[ident]
