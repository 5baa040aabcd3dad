"""The values Mooncake's API takes besides addresses and lengths: ``TransferOpcode``
(with its ``Read``/``Write`` aliases) and ``TransferNotify``, with the payload format
a notification travels in."""

from __future__ import annotations

import enum

import msgpack

__all__ = ["TransferOpcode", "Read", "Write", "TransferNotify"]

_NOTIFY_MAGIC = b"\x00mcn1"  # notification payloads made by TransferNotify


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
