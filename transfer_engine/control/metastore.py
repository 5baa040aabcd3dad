"""Where membership lives: the :class:`MetadataStore` interface and two implementations.

The engine talks to membership only through :class:`MetadataStore`, so a fleet larger
than one registry can keep its members in etcd (``/te/members/<name>`` keys under a
lease, a prefix watch) by adding one class, without touching engine code.

Contract (every implementation):

- ``put(record)`` publishes the caller's own record under a **lease** that this store
  keeps alive until ``delete(name)`` or ``close()``; putting again updates the record.
  If the holder goes silent (process dead, network cut), the lease runs out and every
  watcher sees ``EXPIRE``.
- ``get(name)`` / ``list(role)`` read the current membership; ``get`` raises
  ``UnknownPeerError`` for a name that is not a member.
- ``watch(callback)`` calls ``callback(MemberEvent)`` for each change, from a store
  thread, starting with a ``JOIN`` for every current member; it returns a handle whose
  ``close()`` stops the calls. Callbacks must not block for long.
- Every call that talks to a server takes ``timeout`` (seconds) and raises
  ``TransferTimeout``; ``close()`` is idempotent.

:class:`MemoryStore` is in-process (one object shared by several engines) with an
injectable clock; :class:`RegistryStore` is the embedded ZeroMQ registry.
"""

from __future__ import annotations

import abc
import builtins
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transfer_engine.control.messages import Register
from transfer_engine.errors import ProtocolError, TransferEngineError, UnknownPeerError

__all__ = ["ROLES", "MemberRecord", "EventKind", "MemberEvent", "Subscription",
           "MetadataStore", "MemoryStore"]

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "store", "any")
_MAX_TEXT = 512


@dataclass(frozen=True)
class MemberRecord:
    """What a member publishes: identity, role, placement and how to reach it."""

    name: str
    incarnation: str
    role: str = "any"
    host: str = ""
    pod: str = ""
    zone: str = ""
    control: str = ""  # control endpoint for the peer-to-peer handshake
    transports: dict[str, Any] = field(default_factory=dict)
    nics: list[Any] = field(default_factory=list)
    segments: list[Any] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "incarnation": self.incarnation, "role": self.role,
                "host": self.host, "pod": self.pod, "zone": self.zone,
                "control": self.control, "transports": self.transports,
                "nics": self.nics, "segments": self.segments}

    def to_message(self, token: str = "") -> Register:
        """The registration of this record; ``token`` proves its holder owns the name
        (see :class:`Register`) and is never part of the published record."""
        return Register(**self.to_wire(), token=token)

    @classmethod
    def from_wire(cls, wire: Any, peer: str | None = None) -> MemberRecord:
        """Validates a record from the network; raises ``ProtocolError``."""
        if not isinstance(wire, dict):
            raise ProtocolError("member record is not a map", peer=peer)
        kwargs: dict[str, Any] = {}
        for key in ("name", "incarnation", "role", "host", "pod", "zone", "control"):
            value = wire.get(key, "any" if key == "role" else "")
            if not isinstance(value, str) or len(value) > _MAX_TEXT:
                raise ProtocolError(f"member field {key!r} must be a string of at most "
                                    f"{_MAX_TEXT} characters", peer=peer)
            kwargs[key] = value
        if not kwargs["name"] or not kwargs["incarnation"]:
            raise ProtocolError("member record needs a name and an incarnation", peer=peer)
        if kwargs["role"] not in ROLES:
            raise ProtocolError(f"role {kwargs['role']!r} is not one of {ROLES}", peer=peer)
        for key, kind in (("transports", dict), ("nics", list), ("segments", list)):
            value = wire.get(key, kind())
            if not isinstance(value, kind):
                raise ProtocolError(f"member field {key!r} must be a {kind.__name__}",
                                    peer=peer)
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_message(cls, msg: Register, peer: str | None = None) -> MemberRecord:
        return cls.from_wire({f: getattr(msg, f) for f in msg.__dataclass_fields__}, peer)


class EventKind(enum.Enum):
    JOIN = "join"
    UPDATE = "update"  # same incarnation, new metadata
    LEAVE = "leave"  # said goodbye (or vanished from a full registry snapshot)
    EXPIRE = "expire"  # silent for too long


@dataclass(frozen=True)
class MemberEvent:
    kind: EventKind
    name: str
    record: MemberRecord | None = None  # None for LEAVE / EXPIRE
    reason: str = ""


EventCallback = Callable[[MemberEvent], None]


class Subscription:
    """A watch; ``close()`` (or leaving the ``with`` block) stops the callbacks."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._cancel: Callable[[], None] | None = cancel

    def close(self) -> None:
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetadataStore(abc.ABC):
    """Membership storage with leases (see the module docstring for the contract)."""

    __slots__ = ()

    @abc.abstractmethod
    def put(self, record: MemberRecord, timeout: float | None = None) -> None:
        """Publishes (or updates) our record under a lease this store keeps alive."""

    @abc.abstractmethod
    def get(self, name: str, timeout: float | None = None) -> MemberRecord:
        """The member called ``name``; raises ``UnknownPeerError``."""

    @abc.abstractmethod
    def delete(self, name: str, timeout: float | None = None) -> None:
        """Removes our record (watchers see ``LEAVE``) and stops its lease. Idempotent."""

    @abc.abstractmethod
    def list(self, role: str | None = None, timeout: float | None = None
             ) -> list[MemberRecord]:
        """Current members, all or of one role, sorted by name."""

    @abc.abstractmethod
    def watch(self, callback: EventCallback) -> Subscription:
        """Calls ``callback`` for every membership change from now on (current members
        first, as ``JOIN``)."""

    def publish(self, record: MemberRecord) -> None:
        """Sends an update of our own record without waiting for it to be stored
        (segments came or went); a failure is logged, the next update repairs it."""
        try:
            self.put(record)
        except TransferEngineError as exc:
            log.info("publishing %s: %s", record.name, exc)

    @abc.abstractmethod
    def close(self) -> None:
        """Releases sockets and threads; our records' leases are no longer renewed."""

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStore(MetadataStore):
    """An in-process store shared by several engines, for tests and single-process use.

    Leases are renewed implicitly while a record's holder is "alive"; :meth:`silence`
    simulates a holder that stopped renewing, and :meth:`sweep` expires records whose
    lease (``ttl`` seconds of ``clock``) ran out. Callbacks run synchronously in the
    caller's thread.
    """

    def __init__(self, ttl: float = 3.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.RLock()
        self._records: dict[str, MemberRecord] = {}
        self._renewed: dict[str, float] = {}
        self._silent: set[str] = set()
        self._watchers: dict[int, EventCallback] = {}
        self._ids = iter(range(1, 1 << 62))
        self._closed = False

    def _emit(self, event: MemberEvent) -> None:
        with self._lock:
            watchers = list(self._watchers.values())
        for cb in watchers:
            cb(event)

    def put(self, record: MemberRecord, timeout: float | None = None) -> None:
        with self._lock:
            old = self._records.get(record.name)
            self._records[record.name] = record
            self._renewed[record.name] = self._clock()
            self._silent.discard(record.name)
        if old is None or old.incarnation != record.incarnation:
            self._emit(MemberEvent(EventKind.JOIN, record.name, record))
        elif old != record:
            self._emit(MemberEvent(EventKind.UPDATE, record.name, record))

    def get(self, name: str, timeout: float | None = None) -> MemberRecord:
        self.sweep()
        with self._lock:
            record = self._records.get(name)
        if record is None:
            raise UnknownPeerError("no member of that name", peer=name, op="lookup")
        return record

    def delete(self, name: str, timeout: float | None = None) -> None:
        with self._lock:
            gone = self._records.pop(name, None)
            self._renewed.pop(name, None)
            self._silent.discard(name)
        if gone is not None:
            self._emit(MemberEvent(EventKind.LEAVE, name, reason="left"))

    def list(self, role: str | None = None, timeout: float | None = None
             ) -> list[MemberRecord]:
        self.sweep()
        with self._lock:
            return sorted((r for r in self._records.values() if role in (None, r.role)),
                          key=lambda r: r.name)

    def watch(self, callback: EventCallback) -> Subscription:
        with self._lock:
            wid = next(self._ids)
            self._watchers[wid] = callback
            current = list(self._records.values())
        for record in current:
            callback(MemberEvent(EventKind.JOIN, record.name, record))

        def cancel() -> None:
            with self._lock:
                self._watchers.pop(wid, None)
        return Subscription(cancel)

    def silence(self, name: str) -> None:
        """The holder of ``name`` stops renewing its lease (as if it hung or died)."""
        with self._lock:
            self._silent.add(name)

    def sweep(self) -> builtins.list[str]:
        """Expires silent records whose lease ran out; returns their names."""
        now = self._clock()
        with self._lock:
            for name in self._records:
                if name not in self._silent:
                    self._renewed[name] = now
            expired = [n for n, t in self._renewed.items() if now - t > self.ttl]
            for name in expired:
                del self._records[name], self._renewed[name]
                self._silent.discard(name)
        for name in expired:
            self._emit(MemberEvent(EventKind.EXPIRE, name,
                                   reason=f"no renewal for {self.ttl}s"))
        return expired

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._watchers.clear()
