"""Versioned control messages, msgpack on the wire.

Every message is a frozen dataclass with a ``kind`` tag. :func:`decode` checks size,
version, kind and fields before building one, and raises :class:`ProtocolError` naming
the peer for anything else, so a malformed message never reaches engine code.

Protocol versions:
    1: hello/welcome handshake with engine metadata; segment queries; errors.
    2: registry kinds (register, heartbeat, leave, lookup, list, watch and their
       replies), ``denied`` for failed authentication, a size limit per kind
       (``Message.max_bytes``); v1 kinds unchanged. Peers must speak the same version.
    3: registry ownership and paging: ``register``, ``heartbeat`` and ``leave`` carry the
       member's secret owner ``token`` (never published); ``list`` / ``members`` and
       ``watch`` / ``events`` page through any number of members (``after`` / ``next``
       cursors). Other kinds unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from transfer_engine.errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "Message", "Hello", "Welcome",
           "SegmentsRequest", "SegmentsReply", "ErrorReply", "Denied", "Register",
           "Registered", "Heartbeat", "HeartbeatAck", "Leave", "Lookup", "ListMembers",
           "Members", "Watch", "Events", "Ack", "encode", "encode_packed", "decode",
           "message"]

PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = 4 << 20

_KINDS: dict[str, type[Message]] = {}


@dataclass(frozen=True, slots=True)
class Message:
    kind: ClassVar[str] = ""
    max_bytes: ClassVar[int] = MAX_MESSAGE_BYTES  # encoded size limit of this kind


_M = TypeVar("_M", bound=type[Message])


def message(cls: _M) -> _M:
    """Class decorator: makes ``cls`` decodable by its ``kind``."""
    if cls.kind in _KINDS:
        raise TypeError(f"message kind {cls.kind!r} defined twice")
    _KINDS[cls.kind] = cls
    return cls


@message
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Initiator -> target: who I am (my metadata)."""

    kind: ClassVar[str] = "hello"
    meta: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Target -> initiator: my metadata (transports, segments) and the ticket that lets
    the initiator open rails to me (:mod:`~transfer_engine.control.tickets`)."""

    kind: ClassVar[str] = "welcome"
    meta: dict[str, Any] = field(default_factory=dict)
    ticket: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class SegmentsRequest(Message):
    kind: ClassVar[str] = "segments?"
    name: str = ""


@message
@dataclass(frozen=True, slots=True)
class SegmentsReply(Message):
    kind: ClassVar[str] = "segments"
    segments: list[dict[str, Any]] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    kind: ClassVar[str] = "error"
    message: str = ""


@message
@dataclass(frozen=True, slots=True)
class Denied(Message):
    """Reply to a message that failed authentication (sent unsigned: the sender may not
    hold our secret). The client reports it as ``AuthenticationError``."""

    kind: ClassVar[str] = "denied"
    max_bytes: ClassVar[int] = 4096
    reason: str = ""


# --- registry (v2) --------------------------------------------------------------------

SMALL = 4096  # limit of the fixed-size registry kinds


@message
@dataclass(frozen=True, slots=True)
class Register(Message):
    """Member -> registry: join, or update our record (same ``token``).

    ``incarnation`` is random per member start and public (peers compare it to tell a
    restarted member from a live one). ``token`` is random per registry client and known
    only to it and the registry: it proves ownership of ``name`` for updates,
    heartbeats and leave, and is never published."""

    kind: ClassVar[str] = "register"
    max_bytes: ClassVar[int] = 1 << 20
    name: str = ""
    incarnation: str = ""
    role: str = ""  # prefill | decode | store | any
    host: str = ""
    pod: str = ""
    zone: str = ""
    control: str = ""  # the member's control endpoint (peer-to-peer handshake)
    transports: dict[str, Any] = field(default_factory=dict)  # name -> endpoint info
    nics: list[Any] = field(default_factory=list)
    segments: list[Any] = field(default_factory=list)
    token: str = ""  # owner proof (v3); never published


@message
@dataclass(frozen=True, slots=True)
class Registered(Message):
    """Registry -> member: accepted; heartbeat every ``interval`` seconds, dropped after
    ``max_missed`` silent intervals."""

    kind: ClassVar[str] = "registered"
    max_bytes: ClassVar[int] = SMALL
    epoch: str = ""  # random per registry start
    interval: float = 1.0
    max_missed: int = 3


@message
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    kind: ClassVar[str] = "heartbeat"
    max_bytes: ClassVar[int] = SMALL
    name: str = ""
    incarnation: str = ""
    token: str = ""  # the registering client's owner token (v3)


@message
@dataclass(frozen=True, slots=True)
class HeartbeatAck(Message):
    """``known`` False: the registry lost or dropped us (restart, expiry): re-register."""

    kind: ClassVar[str] = "heartbeat!"
    max_bytes: ClassVar[int] = SMALL
    known: bool = True
    epoch: str = ""


@message
@dataclass(frozen=True, slots=True)
class Leave(Message):
    """Only the owner may leave: ``incarnation`` and ``token`` must match the member's."""

    kind: ClassVar[str] = "leave"
    max_bytes: ClassVar[int] = SMALL
    name: str = ""
    incarnation: str = ""
    token: str = ""  # the registering client's owner token (v3)


@message
@dataclass(frozen=True, slots=True)
class Lookup(Message):
    kind: ClassVar[str] = "lookup"
    max_bytes: ClassVar[int] = SMALL
    name: str = ""


@message
@dataclass(frozen=True, slots=True)
class ListMembers(Message):
    """``role`` empty: every member. One page of members whose names sort after
    ``after`` (v3); the reply's ``next`` asks for the following page."""

    kind: ClassVar[str] = "list"
    max_bytes: ClassVar[int] = SMALL
    role: str = ""
    after: str = ""


@message
@dataclass(frozen=True, slots=True)
class Members(Message):
    """Reply to lookup (one record) and list: member records (``Register`` bodies
    without the token), sorted by name. ``next`` non-empty: more pages follow, ask with
    ``ListMembers(after=next)``."""

    kind: ClassVar[str] = "members"
    members: list[dict[str, Any]] = field(default_factory=list)
    next: str = ""


@message
@dataclass(frozen=True, slots=True)
class Watch(Message):
    """Long poll: answered as soon as events after ``since`` exist in ``epoch``, or after
    ``wait`` seconds with none. A different epoch, or ``since`` < 0, gets a snapshot.
    ``after`` non-empty (v3): the next page of the snapshot taken at seq ``since``."""

    kind: ClassVar[str] = "watch"
    max_bytes: ClassVar[int] = SMALL
    epoch: str = ""
    since: int = -1
    wait: float = 1.0
    after: str = ""


@message
@dataclass(frozen=True, slots=True)
class Events(Message):
    """Events ``{"seq", "type": join|update|leave|expire|resync, "name", "member",
    "reason"}`` after the watched seq; with ``snapshot`` the full member list instead.
    ``complete`` False: the registry restarted recently and is still relearning its
    members from their heartbeats, so absence from the snapshot means nothing yet.

    Paging (v3): events are cut into pages, ``seq`` being the last event included. A
    snapshot page holds the members whose names sort after ``after`` (empty: the first
    page); ``next`` non-empty: more pages follow, ask ``Watch(since=seq, after=next)``."""

    kind: ClassVar[str] = "events"
    epoch: str = ""
    seq: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    snapshot: bool = False
    members: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    after: str = ""
    next: str = ""


@message
@dataclass(frozen=True, slots=True)
class Ack(Message):
    kind: ClassVar[str] = "ack"
    max_bytes: ClassVar[int] = SMALL


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "bool": bool,
    "dict[str, Any]": dict, "list[dict[str, Any]]": list, "list[Any]": list,
}


def _field_error(annotation: str, value: Any) -> str | None:
    """Why ``value`` does not fit a field annotated ``annotation`` (None: it fits).

    bool is not accepted as a number, floats must be finite, and a list of maps must
    hold only maps: a malformed message must fail here, not deep in engine code."""
    expected = _FIELD_TYPES.get(annotation, object)
    if not isinstance(value, expected):
        return f"type {type(value).__name__}"
    if annotation in ("int", "float") and isinstance(value, bool):
        return "type bool"
    if annotation == "float" and not math.isfinite(value):  # type: ignore[arg-type]
        return f"type {type(value).__name__} (not finite)"
    if annotation == "list[dict[str, Any]]":
        items: list[Any] = value  # type: ignore[assignment]
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                return f"type list with a {type(item).__name__} at index {i}"
    return None


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    data: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "kind": msg.kind, "body": body})
    if len(data) > msg.max_bytes:
        raise ProtocolError(f"{msg.kind} message of {len(data)} bytes exceeds its limit of "
                            f"{msg.max_bytes}")
    return data


_FIELD_NAMES: dict[str, tuple[str, ...]] = {}  # kind -> field names, for encode_packed


def _field_names(msg: Message) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(msg.kind)
    if names is None:
        names = _FIELD_NAMES[msg.kind] = tuple(f.name for f in dataclasses.fields(msg))
    return names


def encode_packed(msg: Message, **packed: list[bytes]) -> bytes:
    """:func:`encode`, with the named list fields given as items already msgpack-encoded
    (``packed`` maps field name -> items): a registry reply of many stored records is
    joined from their bytes, not re-encoded. The bytes equal ``encode`` of the same
    message with those items decoded."""
    names = _field_names(msg)
    unknown = set(packed) - set(names)
    if unknown:
        raise TypeError(f"{msg.kind} has no field {sorted(unknown)[0]!r}")
    packer = msgpack.Packer()
    parts = [packer.pack_map_header(3), packer.pack("v"), packer.pack(PROTOCOL_VERSION),
             packer.pack("kind"), packer.pack(msg.kind), packer.pack("body"),
             packer.pack_map_header(len(names))]
    for name in names:
        parts.append(packer.pack(name))
        items = packed.get(name)
        if items is None:
            parts.append(packer.pack(getattr(msg, name)))
        else:
            parts.append(packer.pack_array_header(len(items)))
            parts.extend(items)
    data = b"".join(parts)
    if len(data) > msg.max_bytes:
        raise ProtocolError(f"{msg.kind} message of {len(data)} bytes exceeds its limit of "
                            f"{msg.max_bytes}")
    return data


def decode(data: bytes, peer: str | None = None) -> Message:
    """Parses one message; raises ``ProtocolError(peer=...)`` on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit", peer=peer)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable message: {exc}", peer=peer) from exc
    if not isinstance(raw, dict):
        raise ProtocolError("message is not a map", peer=peer)
    version = raw.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} not supported (we speak "
                            f"{PROTOCOL_VERSION})", peer=peer)
    kind = raw.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {raw.get('kind')!r}", peer=peer)
    if len(data) > cls.max_bytes:
        raise ProtocolError(f"{cls.kind} message of {len(data)} bytes exceeds its limit of "
                            f"{cls.max_bytes}", peer=peer)
    body = raw.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.kind}: body is not a map", peer=peer)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            raise ProtocolError(f"{cls.kind}: missing field {f.name!r}", peer=peer)
        value = body[f.name]
        problem = _field_error(str(f.type), value)
        if problem is not None:
            raise ProtocolError(f"{cls.kind}: field {f.name!r} has {problem}", peer=peer)
        kwargs[f.name] = value
    return cls(**kwargs)
