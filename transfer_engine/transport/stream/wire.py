"""The stream transports' wire format (tcp, shm): requests, answers, the opening.

One rail is one stream connection: one request, one answer, in order.

Opening (see :mod:`transfer_engine.control.tickets`): on accept the target sends a
challenge; the initiator answers with a HELLO that proves it holds a ticket from the
control handshake; the target answers with its own proof and from then on takes every
request on the connection as that ticket's peer's. A connection that does not open
this way is answered with a bare "rail refused" and closed: a stranger learns nothing
about segments, peers or why.

Wire format (little-endian; one request, one answer, in order on each connection):

    challenge = magic "TEr4" nonce(32)                       (target, on accept)
    request  = header(32) remote local[n_local](16 each) body[body_len] payload
    header   = kind u8, flags u8, n_remote u16, n_local u16, pad u16, body_len u32,
               wr_id u64, transfer_id u64, expected u32
    flags    = 1: with immediate; 2: uniform remote entries; 4: sent before, on another
               rail of this connection (its immediate counts once); 8: the immediate
               is a later attempt's (the body begins with the first attempt's
               transfer id, u64: the target notifies once for all attempts)
    remote   = n_remote of (segment u64, offset u64, length u64)   (target memory)
             | uniform: segment u64, length u64, then n_remote offsets u64
             | ANNOUNCE: n_remote of (address u64, length u64, writable u64)
    local    = address u64, length u64                    (initiator memory, shm only)
    body     = HELLO: msgpack {version, ticket, nonce, proof, pid};
               WRITE with immediate: [first attempt's transfer id u64] notify bytes
    payload  = the bytes (tcp WRITE only)
    answer   = kind u8 (0x81), status u8 (0 ok, else an error code), pad u16,
               body_len u32, wr_id u64; body = msgpack error details (the HELLO's: the
               target's proof); then, for a tcp READ that succeeded, the bytes.

ANNOUNCE (shm) tells the target which ranges of the initiator's memory are registered
segments: the target copies to or from no other initiator memory.

Entries are whole 64-bit words, so the target reads them as one aligned ``(n, 3)``
array and checks a request of a thousand blocks with a handful of array operations.
Blocks of one length in one segment (the paged-KV case) travel as their offsets alone:
a third of the bytes, and one reduction to check them all. Each NumPy call counts here:
the kernel's copy of a batch evicts the caches, so a call costs 10-15 us when the next
request comes, several times its warm cost.
Versions (``version`` in the HELLO): 1, 20-byte remote entries (segment u32); 2, 24-byte
entries; 3, uniform entries added; 4, the challenge, ticket-bound rails and ANNOUNCE;
5, flag 8 (a later attempt names its first).

Bounds (:mod:`.server` enforces them): a connection must open within
``HELLO_TIMEOUT`` seconds; at most ``MAX_OPENING`` connections may be opening at once (a
new one pushes out the oldest: a peer opens in one round trip, so a crowd of stalled
openings cannot lock it out) and ``MAX_CONNECTIONS`` may be open in all (more are
closed at once); once open, a request that has begun must keep arriving (and an answer
keep leaving) with no pause longer than the stall timeout, or the rail is dropped, its
thread and socket freed. An open rail may stay idle between requests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import msgpack
import numpy as np

from transfer_engine.errors import (
    ProtocolError,
    TransferError,
    error_code,
    error_from_wire,
)
from transfer_engine.planner import Extents
from transfer_engine.transport.base import Work

WIRE_VERSION = 5
KIND_HELLO, KIND_WRITE, KIND_READ, KIND_ANNOUNCE, KIND_ANSWER = 1, 2, 3, 4, 0x81
KIND_DEVICES = 5  # shm: the initiator's device segments and their IPC handles
# FLAG_FIRST: the immediate is a later attempt's; the body begins with FIRST, the
# transfer id of the transfer's first attempt (the notification follows it)
FLAG_IMM, FLAG_UNIFORM, FLAG_RESENT, FLAG_FIRST = 1, 2, 4, 8
HEADER = struct.Struct("<BBHHHIQQI")
FIRST = struct.Struct("<Q")
UNIFORM = struct.Struct("<QQ")  # segment, length of every entry
ANSWER = struct.Struct("<BBHIQ")
REMOTE_WORDS = 3  # segment, offset, length: u64 each
LOCAL_DT = np.dtype([("address", "<u8"), ("length", "<u8")])
MAX_ENTRIES = 1024  # IOV_MAX: one request is one gathered system call
MAX_BODY = 1 << 20
MAX_REQUEST_BYTES = 1 << 30
MAX_ANNOUNCED = 1 << 16  # ranges an initiator may announce


def pack_remote(remote: Sequence[tuple[int, int, int]]) -> bytes:
    """The ``remote`` entries of a request: (segment, offset, length) u64 words."""
    if isinstance(remote, Extents):
        entries = np.empty((len(remote), REMOTE_WORDS), dtype="<u8")
        entries[:, 0] = remote.segment
        entries[:, 1] = remote.offset
        entries[:, 2] = remote.length
        return entries.tobytes()
    return struct.pack("<" + "QQQ" * len(remote), *chain.from_iterable(remote))


def pack_uniform(segment: int, length: int, offsets: np.ndarray) -> bytes:
    """The ``remote`` entries of a uniform request (``FLAG_UNIFORM``)."""
    return UNIFORM.pack(segment, length) + np.asarray(offsets, dtype="<u8").tobytes()


def pack_local(local: Sequence[tuple[int, int]]) -> bytes:
    """The ``local`` entries of a request (LOCAL_DT records): (address, length)."""
    return struct.pack("<" + "QQ" * len(local), *chain.from_iterable(local))


def encode_request(kind: int, work: Work | None, body: bytes = b"", local: bytes = b""
                   ) -> bytes:
    """Header, entries and body of one request, in one buffer (the payload follows).

    ``local`` is :func:`pack_local` output (shm only).
    """
    if work is None:
        return HEADER.pack(kind, 0, 0, 0, 0, len(body), 0, 0, 0) + body
    imm = work.imm
    flags = FLAG_IMM if imm is not None else 0
    if work.resent:
        flags |= FLAG_RESENT
    if imm is not None and imm.notify:
        body = imm.notify
    if imm is not None and imm.first is not None:
        flags |= FLAG_FIRST
        body = FIRST.pack(imm.first) + body
    remote = work.remote
    n_remote = len(remote)
    if n_remote > MAX_ENTRIES:
        raise ValueError(f"{n_remote} remote entries in one request (at most {MAX_ENTRIES})")
    if isinstance(remote, Extents) and remote.uniform is not None:
        flags |= FLAG_UNIFORM
        entries = pack_uniform(*remote.uniform, remote.offset)
    else:
        entries = pack_remote(remote)
    header = HEADER.pack(kind, flags, n_remote, len(local) // LOCAL_DT.itemsize, 0,
                         len(body), work.wr_id, imm.transfer_id if imm else 0,
                         imm.expected if imm else 0)
    return b"".join((header, entries, local, body))


def take_first(flags: int, body: bytes, peer: str) -> tuple[int | None, bytes]:
    """A request's ``body`` less the first attempt's id that begins it where the flags
    say so (``FLAG_FIRST``, with an immediate), and that id (else None)."""
    if not (flags & FLAG_FIRST and flags & FLAG_IMM):
        return None, body
    if len(body) < FIRST.size:
        raise ProtocolError("a later attempt's immediate without its first attempt's id",
                            peer=peer)
    return FIRST.unpack_from(body)[0], body[FIRST.size:]


class Entries(NamedTuple):
    """A WRITE's or READ's entries and body as its target reads them, every length
    bounded: the remote rows (segment, offset, length), or with ``FLAG_UNIFORM`` one
    segment and length for all offsets; ``low`` and ``high`` the rows' column minima
    and maxima; ``nbytes`` the bytes they name."""

    remote: np.ndarray | None
    uniform: tuple[int, int, np.ndarray] | None
    low: list[int]
    high: list[int]
    local: np.ndarray | None
    first: int | None
    body: bytes
    nbytes: int


def entries_size(flags: int, n_remote: int, n_local: int, body_len: int, peer: str
                 ) -> int:
    """Bytes of a request's entries and body, which follow its header; ProtocolError
    past the bounds, before any is read."""
    if n_remote > MAX_ENTRIES or n_local > MAX_ENTRIES or body_len > MAX_BODY:
        raise ProtocolError("request too large", peer=peer)
    remote = UNIFORM.size + n_remote * 8 if flags & FLAG_UNIFORM else n_remote * REMOTE_WORDS * 8
    return remote + n_local * LOCAL_DT.itemsize + body_len


def decode_entries(blob: bytes, flags: int, n_remote: int, n_local: int, peer: str
                   ) -> Entries:
    """The :class:`Entries` of ``blob`` (:func:`entries_size` bytes); ProtocolError
    for a request naming more than ``MAX_REQUEST_BYTES``."""
    uniform = None
    remote = None
    low = high = [0, 0, 0]
    nbytes = 0
    if flags & FLAG_UNIFORM:
        seg_id, length = UNIFORM.unpack_from(blob)
        if length > MAX_REQUEST_BYTES:
            raise ProtocolError("request too large", peer=peer, length=length)
        uniform = (seg_id, length, np.frombuffer(blob, "<u8", n_remote, UNIFORM.size))
        nbytes = n_remote * length
        remote_end = UNIFORM.size + n_remote * 8
    else:
        remote = np.frombuffer(blob, "<u8", n_remote * REMOTE_WORDS).reshape(
            n_remote, REMOTE_WORDS)
        if n_remote:
            low, high = remote.min(axis=0).tolist(), remote.max(axis=0).tolist()
            if high[2] > MAX_REQUEST_BYTES:
                raise ProtocolError("request too large", peer=peer, length=high[2])
            # no wrap-around: every length is bounded
            nbytes = n_remote * high[2] if low[2] == high[2] else int(remote[:, 2].sum())
        remote_end = n_remote * REMOTE_WORDS * 8
    if nbytes > MAX_REQUEST_BYTES:
        raise ProtocolError("request too large", peer=peer, length=nbytes)
    local_end = remote_end + n_local * LOCAL_DT.itemsize
    local = np.frombuffer(blob, LOCAL_DT, n_local, remote_end) if n_local else None
    first, body = take_first(flags, blob[local_end:], peer)
    return Entries(remote, uniform, low, high, local, first, body, nbytes)


def encode_announce(ranges: np.ndarray) -> bytes:
    """An ANNOUNCE request: ``ranges`` rows of (address, length, writable)."""
    rows = np.ascontiguousarray(ranges, dtype="<u8").reshape(-1, 3)
    if len(rows) > MAX_ANNOUNCED:
        raise ValueError(f"{len(rows)} ranges to announce (at most {MAX_ANNOUNCED})")
    body = rows.tobytes()
    return HEADER.pack(KIND_ANNOUNCE, 0, 0, 0, 0, len(body), 0, 0, 0) + body


def pack_error(exc: TransferError) -> bytes:
    data: bytes = msgpack.packb({"code": error_code(exc), "message": exc.message,
                                 "segment": exc.segment, "offset": exc.offset,
                                 "length": exc.length}, default=str)
    return data


def unpack_error(body: bytes, status: int, peer: str, op: str, transport: str) -> TransferError:
    try:
        info = msgpack.unpackb(body)
        return error_from_wire(int(info.get("code", status)), str(info.get("message")),
                               peer=peer, op=op, transport=transport,
                               segment=info.get("segment"), offset=info.get("offset"),
                               length=info.get("length"))
    except Exception:  # a garbled error report is still an error report
        return error_from_wire(status, "peer reported an error", peer=peer, op=op,
                               transport=transport)
