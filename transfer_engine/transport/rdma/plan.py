"""The hardware-free half of the RDMA transport: pure functions, no pyverbs import.

Everything that can be decided without a NIC lives here so that it is tested on any
machine: the 32-bit immediate format, turning a rail's work into verbs work-request
descriptions bounded by the device's ``max_sge`` and ``max_msg_sz``, mapping completion
statuses to errors, the QP parameters exchanged at connect time and the framing of
notification messages. ``rdma.py`` only translates these descriptions into pyverbs
objects.

Immediate format (32 bits, sent big-endian on the wire as verbs requires)::

    bits 31..8  transfer id modulo 2**24   (wraps around)
    bits  7..0  expected immediates, 1..255 (= rails the transfer uses)

A transfer id wraps every 2**24 transfers. The receiver recovers the full id with
:func:`unwrap_transfer_id`: of all ids with these low 24 bits it picks the one nearest
to the last full id it saw from that peer (the way RTP extends sequence numbers). That is
exact while a peer's transfers in flight span fewer than 2**23 ids, which holds with
several orders of magnitude to spare. Notification messages (SEND) carry the full 64-bit
id in their header, so they need no unwrapping.
"""

from __future__ import annotations

import enum
import random
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    InvalidDescriptorError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    TransferError,
)
from transfer_engine.planner import ExtentRow

__all__ = [
    "IMM_ID_BITS", "IMM_COUNT_BITS", "MAX_EXPECTED", "encode_imm", "decode_imm",
    "unwrap_transfer_id", "ImmUnwrapper", "Opcode", "MrKey", "Sge", "WrSpec",
    "build_work_requests", "WcStatus", "WcOpcode", "wc_error", "wc_retryable", "QpInfo", "mtu_enum",
    "mtu_bytes", "negotiate_mtu", "random_psn", "NOTIFY_HEADER", "pack_notify",
    "unpack_notify", "stripe_pairs", "CqRoom",
]

IMM_ID_BITS = 24
IMM_COUNT_BITS = 32 - IMM_ID_BITS
MAX_EXPECTED = (1 << IMM_COUNT_BITS) - 1
_ID_MOD = 1 << IMM_ID_BITS



def encode_imm(transfer_id: int, expected: int) -> int:
    """Packs ``(transfer_id mod 2**24, expected)`` into the 32-bit immediate (host order)."""
    if not 1 <= expected <= MAX_EXPECTED:
        raise ValueError(f"expected must be in 1..{MAX_EXPECTED}, got {expected}")
    if transfer_id < 0:
        raise ValueError(f"transfer_id must be >= 0, got {transfer_id}")
    return ((transfer_id % _ID_MOD) << IMM_COUNT_BITS) | expected


def decode_imm(value: int) -> tuple[int, int]:
    """Splits an immediate into ``(wrapped transfer id, expected)``."""
    if not 0 <= value < (1 << 32):
        raise ValueError(f"immediate must fit in 32 bits, got {value}")
    return value >> IMM_COUNT_BITS, value & MAX_EXPECTED


def unwrap_transfer_id(wrapped: int, reference: int) -> int:
    """The full id with low bits ``wrapped`` nearest to ``reference`` (never negative)."""
    if not 0 <= wrapped < _ID_MOD:
        raise ValueError(f"wrapped id must be in 0..{_ID_MOD - 1}, got {wrapped}")
    base = reference - (reference % _ID_MOD)
    best = base + wrapped
    for cand in (best - _ID_MOD, best + _ID_MOD):
        if cand >= 0 and abs(cand - reference) < abs(best - reference):
            best = cand
    return best


class ImmUnwrapper:
    """Recovers full transfer ids per peer from wrapped immediates.

    Not thread-safe: one instance belongs to one completion-polling thread.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def full_id(self, peer: str, wrapped: int) -> int:
        full = unwrap_transfer_id(wrapped, self._last.get(peer, 0))
        if full > self._last.get(peer, -1):
            self._last[peer] = full
        return full

    def observe(self, peer: str, full_id: int) -> None:
        """Feeds a full id learnt elsewhere (a notification header) as the reference."""
        if full_id > self._last.get(peer, -1):
            self._last[peer] = full_id

    def forget(self, peer: str) -> None:
        self._last.pop(peer, None)


class Opcode(enum.IntEnum):
    """Send opcodes, valued as ``enum ibv_wr_opcode`` so they pass straight to verbs."""

    WRITE = 0
    WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    READ = 4


@dataclass(frozen=True, slots=True)
class MrKey:
    """How a NIC addresses a registered segment: byte ``k`` is at ``base + k``.

    ``base`` is the segment's virtual address for ordinary registrations and the
    dma-buf offset (the MR's iova) for dma-buf registrations of GPU memory.
    """

    base: int
    length: int
    key: int  # lkey for local segments, rkey for remote ones


@dataclass(frozen=True, slots=True)
class Sge:
    addr: int
    length: int
    lkey: int


@dataclass(frozen=True, slots=True)
class WrSpec:
    """One verbs send work request, described."""

    opcode: Opcode
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int
    signaled: bool = False
    imm: int | None = None  # host order; the rail converts to network order

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.sges)


def _resolve(ext: ExtentRow, keys: Mapping[int, MrKey], side: str,
             ctx: dict[str, Any]) -> MrKey:
    seg, off, length = ext[0], ext[1], ext[2]
    mr = keys.get(seg)
    if mr is None:
        raise InvalidDescriptorError(f"{side} segment {seg} is not registered "
                                     "with this RDMA device", segment=seg,
                                     offset=off, length=length, **ctx)
    if off < 0 or length <= 0 or off + length > mr.length:
        raise InvalidDescriptorError(f"{side} range out of bounds of a {mr.length}-byte "
                                     "registration", segment=seg, offset=off,
                                     length=length, **ctx)
    return mr


def _byte_runs(local: Sequence[ExtentRow], remote: Sequence[ExtentRow],
               local_keys: Mapping[int, MrKey], remote_keys: Mapping[int, MrKey],
               ctx: dict[str, Any]) -> list[tuple[int, int, int, int, int]]:
    """Walks both sides in byte order: ``(laddr, lkey, raddr, rkey, length)`` runs."""
    if sum(e[2] for e in local) != sum(e[2] for e in remote):
        raise InvalidDescriptorError("local and remote byte counts differ", **ctx)
    runs: list[tuple[int, int, int, int, int]] = []
    li = ri = 0
    loff = roff = 0
    while li < len(local) and ri < len(remote):
        lext, rext = local[li], remote[ri]
        lmr = _resolve(lext, local_keys, "local", ctx)
        rmr = _resolve(rext, remote_keys, "remote", ctx)
        n = min(lext[2] - loff, rext[2] - roff)
        runs.append((lmr.base + lext[1] + loff, lmr.key, rmr.base + rext[1] + roff,
                     rmr.key, n))
        loff += n
        roff += n
        if loff == lext[2]:
            li, loff = li + 1, 0
        if roff == rext[2]:
            ri, roff = ri + 1, 0
    return runs


def build_work_requests(op: Op, local: Sequence[ExtentRow], remote: Sequence[ExtentRow], *,
                        local_keys: Mapping[int, MrKey], remote_keys: Mapping[int, MrKey],
                        max_sge: int, max_msg_size: int, imm: int | None = None,
                        signal_every: int = 0, peer: str | None = None
                        ) -> list[WrSpec]:
    """Turns one rail work (planner order) into verbs work requests.

    ``local``/``remote`` are ``(segment id, offset, length)`` extents, as in
    ``planner.WorkRequest`` and ``base.Work``.

    Each request has one contiguous remote range (RDMA WRITE/READ cannot scatter
    remotely), at most ``max_sge`` local entries and at most ``max_msg_size`` bytes;
    adjacent local extents under one key merge into one entry. Only the last request is
    signaled (an RC queue pair completes in order, so its completion covers the earlier
    ones) plus every ``signal_every``-th one when set, so a long work cannot fill the send
    queue with unsignaled entries. With ``imm`` the last request is WRITE_WITH_IMM.
    Raises ``InvalidDescriptorError`` for unregistered or out-of-bounds extents.
    """
    if max_sge < 1 or max_msg_size < 1:
        raise ValueError("max_sge and max_msg_size must be positive")
    if op is Op.READ and imm is not None:
        raise ValueError("RDMA READ carries no immediate")
    ctx: dict[str, Any] = {"peer": peer, "op": str(op), "transport": "rdma"}
    runs = _byte_runs(local, remote, local_keys, remote_keys, ctx)
    if not runs:
        raise InvalidDescriptorError("work has no bytes", **ctx)
    base_op = Opcode.READ if op is Op.READ else Opcode.WRITE
    specs: list[tuple[list[Sge], int, int]] = []  # (sges, remote_addr, rkey)
    cur: list[Sge] = []
    cur_raddr = cur_rkey = cur_bytes = 0
    for laddr, lkey, raddr, rkey, length in runs:
        while length > 0:
            contiguous = (cur and rkey == cur_rkey and raddr == cur_raddr + cur_bytes)
            if not contiguous or cur_bytes >= max_msg_size:
                cur = []
                specs.append((cur, raddr, rkey))
                cur_raddr, cur_rkey, cur_bytes = raddr, rkey, 0
            take = min(length, max_msg_size - cur_bytes)
            last = cur[-1] if cur else None
            if last is not None and last.lkey == lkey and last.addr + last.length == laddr:
                cur[-1] = Sge(last.addr, last.length + take, lkey)
            elif len(cur) < max_sge:
                cur.append(Sge(laddr, take, lkey))
            else:  # SGE list full: start a new request at the current remote address
                cur = [Sge(laddr, take, lkey)]
                specs.append((cur, raddr, rkey))
                cur_raddr, cur_rkey, cur_bytes = raddr, rkey, 0
            cur_bytes += take
            laddr, raddr, length = laddr + take, raddr + take, length - take
    out: list[WrSpec] = []
    for i, (sges, raddr, rkey) in enumerate(specs):
        is_last = i == len(specs) - 1
        signaled = is_last or (signal_every > 0 and (i + 1) % signal_every == 0)
        opcode = Opcode.WRITE_WITH_IMM if (is_last and imm is not None) else base_op
        out.append(WrSpec(opcode, tuple(sges), raddr, rkey, signaled,
                          imm if opcode is Opcode.WRITE_WITH_IMM else None))
    return out


def stripe_pairs(num_local: int, num_remote: int, rail: int) -> tuple[int, int]:
    """The (local NIC, remote NIC) pair rail number ``rail`` uses: NIC pairs by index,
    cycling, so rails spread over every NIC on both sides."""
    if num_local < 1 or num_remote < 1:
        raise ValueError("need at least one NIC on each side")
    return rail % num_local, rail % num_remote


class WcStatus(enum.IntEnum):
    """``enum ibv_wc_status`` values (stable ABI)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


class WcOpcode(enum.IntEnum):
    """``enum ibv_wc_opcode`` values (stable ABI): what a completion completed."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


_WC_ERRORS: dict[int, tuple[type[TransferError], str]] = {
    WcStatus.LOC_PROT_ERR: (InvalidDescriptorError,
                            "local memory is not registered for this access (lkey)"),
    WcStatus.LOC_ACCESS_ERR: (InvalidDescriptorError, "local memory access violation"),
    WcStatus.REM_ACCESS_ERR: (InvalidDescriptorError,
                              "peer refused access: remote segment deregistered, out of "
                              "bounds or read-only (rkey)"),
    WcStatus.LOC_LEN_ERR: (ProtocolError, "work request longer than the receive buffer"),
    WcStatus.LOC_QP_OP_ERR: (ProtocolError, "invalid work request for this queue pair"),
    WcStatus.REM_INV_REQ_ERR: (ProtocolError, "peer rejected the request as invalid"),
    WcStatus.REM_OP_ERR: (RemoteError, "peer could not complete the operation"),
    WcStatus.BAD_RESP_ERR: (ProtocolError, "unexpected response from the peer"),
    WcStatus.RETRY_EXC_ERR: (PeerLostError, "transport retries exceeded: peer unreachable"),
    WcStatus.RNR_RETRY_EXC_ERR: (PeerLostError,
                                 "receiver-not-ready retries exceeded: peer stopped "
                                 "posting receives"),
    WcStatus.RESP_TIMEOUT_ERR: (PeerLostError, "response timeout"),
    WcStatus.REM_ABORT_ERR: (PeerLostError, "peer aborted the operation"),
    WcStatus.FATAL_ERR: (PeerLostError, "fatal device error"),
    WcStatus.GENERAL_ERR: (RemoteError, "general device error"),
}

# Errors of the path, not of the request: the same work may succeed on another rail.
_RETRYABLE = frozenset({WcStatus.RETRY_EXC_ERR, WcStatus.RNR_RETRY_EXC_ERR,
                        WcStatus.RESP_TIMEOUT_ERR, WcStatus.FATAL_ERR,
                        WcStatus.GENERAL_ERR, WcStatus.REM_ABORT_ERR,
                        WcStatus.WR_FLUSH_ERR})


def wc_retryable(status: int) -> bool:
    """Whether a failed completion blames the rail (retry elsewhere) or the request."""
    return status in _RETRYABLE


def wc_error(status: int, vendor_err: int = 0, *, closing: bool = False,
             **ctx: Any) -> TransferError:
    """The precise error for a failed completion. A flush after our own ``close()`` is
    :class:`ClosedError`; one after a failure is the peer's (:class:`PeerLostError`)."""
    try:
        name = WcStatus(status).name
    except ValueError:
        name = f"status {status}"
    detail = f"{name}, vendor_err=0x{vendor_err:x}"
    if status == WcStatus.WR_FLUSH_ERR:
        if closing:
            return ClosedError(f"rail closed with work pending ({detail})", **ctx)
        return PeerLostError(f"queue pair entered the error state ({detail})", **ctx)
    cls, text = _WC_ERRORS.get(status, (RemoteError, "unclassified completion error"))
    return cls(f"RDMA completion failed: {text} ({detail})", **ctx)


_MTUS = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
_MTU_BYTES = {v: k for k, v in _MTUS.items()}


def mtu_enum(nbytes: int) -> int:
    """``enum ibv_mtu`` for a byte size."""
    if nbytes not in _MTUS:
        raise ValueError(f"MTU must be one of {sorted(_MTUS)}, got {nbytes}")
    return _MTUS[nbytes]


def mtu_bytes(value: int) -> int:
    if value not in _MTU_BYTES:
        raise ValueError(f"unknown ibv_mtu value {value}")
    return _MTU_BYTES[value]


def negotiate_mtu(ours: int, theirs: int) -> int:
    """The path MTU both ends support (byte sizes in, byte size out)."""
    return min(mtu_bytes(mtu_enum(ours)), mtu_bytes(mtu_enum(theirs)))


def random_psn(rng: random.Random | None = None) -> int:
    """A random 24-bit starting packet sequence number (stale packets of an earlier
    connection to the same QP number are then unlikely to be accepted)."""
    return (rng or random.SystemRandom()).randrange(1 << 24)


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What one side of an RC connection tells the other (msgpack-able via to_wire)."""

    qp_num: int
    lid: int
    gid: str  # "xxxx:xxxx:...:xxxx" (8 groups), all zero when the fabric is IB without GRH
    gid_index: int
    psn: int
    mtu: int  # bytes
    device: str
    port: int = 1

    def to_wire(self) -> dict[str, Any]:
        return {"qp_num": self.qp_num, "lid": self.lid, "gid": self.gid,
                "gid_index": self.gid_index, "psn": self.psn, "mtu": self.mtu,
                "device": self.device, "port": self.port}

    @classmethod
    def from_wire(cls, data: Any, peer: str | None = None) -> QpInfo:
        """Validates a peer's QP info; raises ``ProtocolError`` naming the bad field."""
        def bad(msg: str) -> ProtocolError:
            return ProtocolError(f"bad QP info: {msg}", peer=peer, op="connect",
                                 transport="rdma")
        if not isinstance(data, dict):
            raise bad(f"expected a map, got {type(data).__name__}")
        ints = {"qp_num": 1 << 24, "lid": 1 << 16, "gid_index": 1 << 16, "psn": 1 << 24,
                "port": 256}
        for key, limit in ints.items():
            value = data.get(key, 1 if key == "port" else None)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
                raise bad(f"{key}={value!r} is not an integer in 0..{limit - 1}")
        gid = data.get("gid")
        if not isinstance(gid, str) or len(gid.split(":")) != 8 or not all(
                len(g) == 4 and all(c in "0123456789abcdefABCDEF" for c in g)
                for g in gid.split(":")):
            raise bad(f"gid={gid!r} is not 8 groups of 4 hex digits")
        mtu = data.get("mtu")
        if mtu not in _MTUS:
            raise bad(f"mtu={mtu!r} is not one of {sorted(_MTUS)}")
        device = data.get("device")
        if not isinstance(device, str) or not device:
            raise bad(f"device={device!r} is not a name")
        return cls(data["qp_num"], data["lid"], gid.lower(), data["gid_index"], data["psn"],
                   mtu, device, data.get("port", 1))


# Notification SEND payload: header then the notify bytes. The header repeats the
# immediate's facts with the full 64-bit id, names the rail the immediate stands for
# so a retry on another rail is counted once, and, for a later attempt of a transfer,
# the first attempt's id (0: none), so that the target notifies once for all of them.
NOTIFY_HEADER = struct.Struct("<QIHHQ")  # transfer_id, expected, origin rail, flags, first
_HAS_NOTIFY = 1  # flags: the payload is the transfer's notification


def pack_notify(transfer_id: int, expected: int, origin_rail: int,
                payload: bytes | None, first: int | None = None) -> bytes:
    """The SEND payload; ``payload`` None: an immediate that carries no notification
    (one moved to a SEND by a rail failover), told apart from an empty notification."""
    flags = _HAS_NOTIFY if payload is not None else 0
    return NOTIFY_HEADER.pack(transfer_id, expected, origin_rail, flags,
                              first or 0) + (payload or b"")


def unpack_notify(data: bytes | memoryview, peer: str | None = None
                  ) -> tuple[int, int, int, bytes | None, int | None]:
    """``(transfer_id, expected, origin_rail, payload or None, first or None)``;
    ``ProtocolError`` if short."""
    if len(data) < NOTIFY_HEADER.size:
        raise ProtocolError(f"notification of {len(data)} bytes is shorter than its "
                            "header", peer=peer, transport="rdma")
    tid, expected, origin, flags, first = NOTIFY_HEADER.unpack_from(data)
    if expected < 1:
        raise ProtocolError("notification expects no immediates", peer=peer,
                            transport="rdma")
    payload = bytes(data[NOTIFY_HEADER.size:]) if flags & _HAS_NOTIFY else None
    return tid, expected, origin, payload, first or None


class CqRoom:
    """Keeps a completion queue from overrunning: every queue pair on it reserves one
    entry per work request it can have outstanding (``max_send_wr + max_recv_wr``:
    after a failure every one of them, signaled or not, completes with a flush), and a
    queue pair that does not fit is refused instead of overrunning the queue later."""

    __slots__ = ("depth", "used", "_held", "_lock")

    def __init__(self, depth: int) -> None:
        self.depth, self.used = depth, 0
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def reserve(self, n: int, device: str) -> None:
        with self._lock:
            if self.used + n > self.depth:
                raise ConnectError(f"completion queue of {device} is full: {self.used} of "
                                   f"{self.depth} entries held by queue pairs, {n} more "
                                   "needed (raise cq_depth or lower sq_depth)",
                                   transport="rdma", op="connect")
            self.used += n

    def hold(self, key: int, n: int) -> None:
        """Ties a reservation to a queue pair (``id(qp)``) for :meth:`free`."""
        with self._lock:
            self._held[key] = n

    def free(self, key: int) -> None:
        with self._lock:
            self.used -= self._held.pop(key, 0)

    def cancel(self, n: int) -> None:
        with self._lock:
            self.used -= n
