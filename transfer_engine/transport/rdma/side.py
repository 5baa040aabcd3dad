"""The side channel's frames: a length and a msgpack map, read under a size bound.
"""

from __future__ import annotations

import logging
import socket
import struct
from typing import Any

import msgpack

from transfer_engine.errors import (
    PeerLostError,
    ProtocolError,
    error_from_wire,
)
from transfer_engine.transport.rdma.plan import (
    MrKey,
)

log = logging.getLogger(__name__)

WIRE_VERSION = 2  # 2: the notification header names a later attempt's first
_FRAME = struct.Struct("<I")
_MAX_FRAME = 16 << 20
_MAX_OPENING_FRAME = 16 << 10  # a connect message before its ticket is proven


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
