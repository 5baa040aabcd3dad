"""The emulated fabric's wire format: a Unix stream socket per queue pair connection, in
the abstract namespace under the responder's GID (:func:`wire_name`), carrying only
request headers and acknowledgements (bytes move by cross-memory attach)."""

from __future__ import annotations

import struct

__all__ = ["HELLO", "HELLO_MAGIC", "REQ", "FLAG_COUNT", "SGE", "ACK", "KIND_REQ", "KIND_ACK",
           "gid_bytes", "gid_str", "wire_name"]

HELLO = struct.Struct("<4sII16s")  # magic, source QP, destination QP, source GID
HELLO_MAGIC = b"TEQP"
REQ = struct.Struct("<BBHIQIIII")  # kind, opcode, nsge, seq, raddr, rkey, len, imm, flags
FLAG_COUNT = 1  # the requester's NIC counts: check everything, copy nothing
SGE = struct.Struct("<QQ")
ACK = struct.Struct("<BBHII")  # kind, status, pad, seq, byte_len
KIND_REQ, KIND_ACK = 1, 2


def gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def wire_name(gid: str) -> bytes:
    return b"\0te-rdma-emu-" + gid.replace(":", "").encode()
