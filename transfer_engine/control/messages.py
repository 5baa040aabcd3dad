"""Versioned control messages, msgpack on the wire.

Every message is a frozen dataclass with a ``kind`` tag. :func:`decode` checks size,
version, kind and fields before building one, and raises :class:`ProtocolError` naming
the peer for anything else, so a malformed message never reaches engine code.

Protocol versions:
    1: hello/welcome handshake with engine metadata; segment queries; errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from transfer_engine.errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "Message", "Hello", "Welcome",
           "SegmentsRequest", "SegmentsReply", "ErrorReply", "encode", "decode", "message"]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 4 << 20

_KINDS: dict[str, type[Message]] = {}


@dataclass(frozen=True, slots=True)
class Message:
    kind: ClassVar[str] = ""


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
    """Target -> initiator: my metadata (transports, segments)."""

    kind: ClassVar[str] = "welcome"
    meta: dict[str, Any] = field(default_factory=dict)


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


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    data: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "kind": msg.kind, "body": body})
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.kind} message of {len(data)} bytes exceeds the limit")
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
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} not supported (we speak "
                            f"{PROTOCOL_VERSION})", peer=peer)
    cls = _KINDS.get(raw.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message kind {raw.get('kind')!r}", peer=peer)
    body = raw.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.kind}: body is not a map", peer=peer)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            raise ProtocolError(f"{cls.kind}: missing field {f.name!r}", peer=peer)
        value = body[f.name]
        expected = {"str": str, "dict[str, Any]": dict, "list[dict[str, Any]]": list}.get(
            str(f.type), object)
        if not isinstance(value, expected):
            raise ProtocolError(f"{cls.kind}: field {f.name!r} has type "
                                f"{type(value).__name__}", peer=peer)
        kwargs[f.name] = value
    return cls(**kwargs)
