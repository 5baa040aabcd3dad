"""The membership registry: one ZeroMQ ROUTER socket, one thread, msgpack messages.

Protocol (each request gets exactly one reply on the same DEALER):

- ``Register(record)`` -> ``Registered(epoch, interval, max_missed)``: join, or update the
  record of the same ``incarnation``. A name held by another live incarnation is refused
  (``ErrorReply``) until that one leaves or expires.
- ``Heartbeat(name, incarnation)`` -> ``HeartbeatAck(known, epoch)``; ``known`` False
  tells the member to register again (registry restarted, or it was expired).
- ``Leave`` -> ``Ack``; ``Lookup(name)`` / ``ListMembers(role)`` -> ``Members``.
- ``Watch(epoch, since, wait)`` -> ``Events``: a long poll, answered when an event after
  ``since`` exists or after ``wait`` seconds; a stale epoch or an evicted ``since`` gets a
  snapshot of every member.
- Anything unauthenticated -> ``Denied``; malformed, wrong-version or oversized ->
  ``ErrorReply`` with the reason (also logged, rate-limited). Nothing a client sends can
  stop the loop.

A member silent for ``max_missed`` heartbeat intervals is dropped with an ``expire``
event. A registry keeps no state on disk: after a restart it relearns its members from
their next heartbeats (``known`` False -> they register again). Until
``max_missed + 1`` intervals have passed, its snapshots say ``complete=False`` so that
watchers do not take an absent member for a departed one; then it logs a ``resync``
event and watchers fetch a complete snapshot.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from transfer_engine.control.auth import OVERHEAD, AuthConfig, open_request, seal
from transfer_engine.control.messages import (
    Ack,
    Denied,
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
)
from transfer_engine.control.metastore import ROLES, MemberRecord
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ProtocolError,
    TransferError,
)

__all__ = ["Registry"]

log = logging.getLogger(__name__)

_MAX_FRAME = Register.max_bytes + OVERHEAD + 4096  # libzmq drops larger frames outright
_MAX_WAIT = 30.0  # longest long poll


@dataclass
class _Member:
    record: MemberRecord
    last_seen: float


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
        bound one is ``self.endpoint``).
    :param auth: signing of control messages; ``None``: accept unsigned ones.
    :param interval: heartbeat interval, seconds, that members are told to use.
    :param max_missed: silent intervals after which a member is dropped.
    :param log_size: events kept for watchers that fall behind (older ones get a
        snapshot instead).
    :param max_members: registrations beyond this are refused.
    :param clock: monotonic clock (seconds), injectable for tests.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, auth: AuthConfig | None = None,
                 interval: float = 1.0, max_missed: int = 3, log_size: int = 4096,
                 max_members: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0 or max_missed < 1:
            raise ValueError("interval must be positive and max_missed at least 1")
        self.bind = bind
        self.interval = float(interval)
        self.max_missed = int(max_missed)
        self.max_members = max_members
        self.epoch = uuid.uuid4().hex[:16]
        self.endpoint: str | None = None
        self.stats = collections.Counter[str]()
        self._signer = (auth or AuthConfig()).signer()
        self._clock = clock
        self._members: dict[str, _Member] = {}
        self._log: collections.deque[dict[str, Any]] = collections.deque(maxlen=log_size)
        self._seq = 0
        self._waiters: list[tuple[bytes, int, float]] = []  # (ident, since, deadline)
        self._recovering_until = 0.0
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
            sock.setsockopt(zmq.SNDHWM, 100_000)
            if self.bind.endswith(":0"):
                port = sock.bind_to_random_port(self.bind[:-2])
                self.endpoint = f"{self.bind[:-2]}:{port}"
            else:
                sock.bind(self.bind)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(0)
            self._ctx.term()
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
            self._ctx.term()

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def members(self) -> list[MemberRecord]:
        with self._lock:
            return sorted((m.record for m in self._members.values()), key=lambda r: r.name)

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
                ready = poller.poll(self._poll_ms())
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            try:
                now = self._clock()
                if ready:
                    for _ in range(256):  # bounded batch, then housekeeping
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._serve(frames, now)
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

    def _poll_ms(self) -> int:
        return 50

    def _send(self, ident: bytes, msg: Message, signed: bool = True) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, seal(msg, self._signer if signed else None)],
                                      zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats["reply_dropped"] += 1

    def _serve(self, frames: list[bytes], now: float) -> None:
        self.stats["requests"] += 1
        if len(frames) != 2:
            self.stats["rejected"] += 1
            self._reject(f"{len(frames)} frames (expected one)")
            if frames and len(frames) > 1:
                self._send(frames[0], ErrorReply("expected a single-frame message"))
            return
        ident, data = frames
        try:
            msg = open_request(data, self._signer, peer="?")
        except AuthenticationError as exc:
            self.stats["rejected"] += 1
            self.stats["denied"] += 1
            self._reject(str(exc))
            self._send(ident, Denied(exc.message), signed=False)
            return
        except ProtocolError as exc:
            self.stats["rejected"] += 1
            self._reject(str(exc))
            self._send(ident, ErrorReply(str(exc)))
            return
        try:
            reply = self._handle(ident, msg, now)
        except TransferError as exc:
            self.stats["rejected"] += 1
            self._reject(f"{msg.kind}: {exc}")
            reply = ErrorReply(str(exc))
        if reply is not None:
            self._send(ident, reply)

    def _handle(self, ident: bytes, msg: Message, now: float) -> Message | None:
        if isinstance(msg, Heartbeat):
            self.stats["heartbeats"] += 1
            member = self._members.get(msg.name)
            known = member is not None and member.record.incarnation == msg.incarnation
            if member is not None and known:
                member.last_seen = now
            return HeartbeatAck(known, self.epoch)
        if isinstance(msg, Register):
            return self._register(MemberRecord.from_message(msg, peer=msg.name), now)
        if isinstance(msg, Leave):
            member = self._members.get(msg.name)
            if member is not None and member.record.incarnation == msg.incarnation:
                self._drop(msg.name, "leave", "left")
            return Ack()
        if isinstance(msg, Lookup):
            member = self._members.get(msg.name)
            return Members([member.record.to_wire()] if member else [])
        if isinstance(msg, ListMembers):
            if msg.role and msg.role not in ROLES:
                raise ProtocolError(f"role {msg.role!r} is not one of {ROLES}")
            return Members([m.record.to_wire() for m in self._members.values()
                            if not msg.role or m.record.role == msg.role])
        if isinstance(msg, Watch):
            return self._watch(ident, msg, now)
        raise ProtocolError(f"unexpected {msg.kind} at the registry")

    def _register(self, record: MemberRecord, now: float) -> Message:
        old = self._members.get(record.name)
        if old is not None and old.record.incarnation != record.incarnation:
            raise ProtocolError(
                f"name {record.name!r} is held by a live member (incarnation "
                f"{old.record.incarnation}); it is released when that one leaves or after "
                f"{self.interval * self.max_missed:g}s without heartbeats")
        if old is None and len(self._members) >= self.max_members:
            raise ProtocolError(f"registry full ({self.max_members} members)")
        with self._lock:
            self._members[record.name] = _Member(record, now)
        if old is None:
            self.stats["joins"] += 1
            self._event("join", record.name, record, "registered")
        elif old.record != record:
            self._event("update", record.name, record, "metadata changed")
        return Registered(self.epoch, self.interval, self.max_missed)

    def _drop(self, name: str, kind: str, reason: str) -> None:
        with self._lock:
            self._members.pop(name, None)
        self.stats[kind + "s"] += 1
        self._event(kind, name, None, reason)

    def _expire(self, now: float) -> None:
        limit = self.interval * self.max_missed
        for name in [n for n, m in self._members.items() if now - m.last_seen > limit]:
            log.info("registry: %s expired after %.1fs of silence", name, limit)
            self._drop(name, "expire", f"no heartbeat for {limit:g}s")

    def _event(self, kind: str, name: str, record: MemberRecord | None, reason: str) -> None:
        self._seq += 1
        self._log.append({"seq": self._seq, "type": kind, "name": name,
                          "member": record.to_wire() if record else None, "reason": reason})

    # --- watches ----------------------------------------------------------------------

    def _watch(self, ident: bytes, msg: Watch, now: float) -> Message | None:
        self.stats["watches"] += 1
        oldest = self._log[0]["seq"] if self._log else self._seq + 1
        if msg.epoch != self.epoch or msg.since < 0 or msg.since < oldest - 1:
            return self._snapshot(now)
        if msg.since > self._seq:
            raise ProtocolError(f"watch from seq {msg.since} beyond ours ({self._seq})")
        if msg.since < self._seq:
            return self._events_after(msg.since)
        wait = min(max(float(msg.wait), 0.0), _MAX_WAIT)
        self._waiters = [w for w in self._waiters if w[0] != ident]
        self._waiters.append((ident, msg.since, now + wait))
        return None

    def _snapshot(self, now: float) -> Events:
        return Events(self.epoch, self._seq, [], True,
                      [m.record.to_wire() for m in self._members.values()],
                      now >= self._recovering_until)

    def _events_after(self, since: int) -> Events:
        return Events(self.epoch, self._seq, [e for e in self._log if e["seq"] > since])

    def _answer_waiters(self, now: float) -> None:
        if not self._waiters:
            return
        keep = []
        for ident, since, deadline in self._waiters:
            if since < self._seq:
                self._send(ident, self._events_after(since))
            elif now >= deadline:
                self._send(ident, Events(self.epoch, self._seq))
            else:
                keep.append((ident, since, deadline))
        self._waiters = keep


def main(argv: list[str] | None = None) -> None:
    """``python -m transfer_engine.registry --bind tcp://HOST:PORT``: serves until
    interrupted (SIGINT/SIGTERM) or until stdin closes with ``--stdin``."""
    import argparse  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import sys  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m transfer_engine.registry",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="tcp://0.0.0.0:7100",
                        help="ZeroMQ endpoint to bind (port 0: any free port)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="heartbeat interval members are told to use, seconds")
    parser.add_argument("--max-missed", type=int, default=3,
                        help="silent intervals after which a member is dropped")
    parser.add_argument("--stdin", action="store_true",
                        help="stop when stdin closes (for launchers and tests)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auth = AuthConfig.from_env()  # TE_CONTROL_SECRET / TE_CONTROL_SECRET_FILE
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Registry(args.bind, auth=auth, interval=args.interval,
                  max_missed=args.max_missed) as registry:
        print(f"REGISTRY {registry.endpoint} epoch={registry.epoch} "
              f"auth={'hmac' if auth.secret else 'none'}", flush=True)
        if args.stdin:
            def stop_at_eof() -> None:
                sys.stdin.read()
                stop.set()
            threading.Thread(target=stop_at_eof, daemon=True, name="registry-stdin").start()
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
