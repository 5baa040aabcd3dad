"""One RDMA rail: a QP to one NIC of a peer; posts works as chained verbs requests.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from transfer_engine.transport.base import (
    Completion,
    OnComplete,
    Rail,
    Work,
)
from transfer_engine.transport.rdma.batch import WrBatch, build_wr_batch, empty_batch
from transfer_engine.transport.rdma.plan import (
    NOTIFY_HEADER,
    MrKey,
    Opcode,
    Sge,
    WrSpec,
    encode_imm,
    pack_notify,
    wc_error,
    wc_retryable,
)
from transfer_engine.transport.rdma.side import _keys_from_wire, _recv_frame, _send_frame
from transfer_engine.transport.rdma.verbs import Device

log = logging.getLogger(__name__)

WORK_PIECES = 256  # extents per engine work: at most this many verbs requests (< sq_depth)
ABSENT_S = 5.0  # how long a peer's "segment not on this NIC" answer is believed


class RailOwner(Protocol):
    """What a rail needs from the transport that made it (:class:`RdmaTransport`)."""

    sq_depth: int
    max_notify: int
    notify_slots: int

    def local_keys(self, device: str) -> dict[int, MrKey]: ...
    def new_wr_id(self, rail: RdmaRail) -> int: ...
    def side_lock(self, rail: RdmaRail) -> AbstractContextManager[None]: ...
    def defer(self, device: Device, fn: Any, *args: Any) -> None: ...
    def sibling(self, rail: RdmaRail) -> RdmaRail | None: ...
    def forget_wr_ids(self, wr_ids: list[int]) -> None: ...
    def note_failure(self, peer: str) -> None: ...
    def rail_failed(self, rail: RdmaRail) -> None: ...
    def forget_rail(self, rail: RdmaRail) -> None: ...


def _segment_ids(spans: Any) -> set[int]:
    """The segment ids of a work's extents, without a Python object per extent when the
    planner handed them over as columns (``planner.Extents``)."""
    uniform = getattr(spans, "uniform", None)
    if uniform is not None:
        return {int(uniform[0])}
    seg = getattr(spans, "segment", None)
    if seg is not None and hasattr(seg, "tolist"):
        if len(seg) and bool((seg == seg[0]).all()):
            return {int(seg[0])}
        return set(seg.tolist())
    return {int(e[0]) for e in spans}


class RdmaRail(Rail):
    """One RC queue pair from one of our NICs to one of the peer's."""

    __slots__ = ("peer", "index", "device", "remote_device", "_transport", "_qp", "_sock",
                 "_on_complete", "_lock", "_state", "_backlog", "_inflight", "_free_wr",
                 "_remote_keys", "_absent", "_notify_mr", "_notify_free", "_max_sge", "_max_msg",
                 "weight", "reopen")

    def __init__(self, transport: RailOwner, peer: str, index: int, device: Device,
                 remote_device: str, qp: Any, sock: socket.socket,
                 remote_keys: dict[int, MrKey], on_complete: OnComplete) -> None:
        self.peer, self.index, self.device = peer, index, device
        self.remote_device = remote_device
        self.weight = device.link_rate_gbps or 1.0  # for the planner's striping weights
        self._transport, self._qp, self._sock = transport, qp, sock
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._state = "OPEN"
        self._backlog: collections.deque[tuple[Work, int]] = collections.deque()
        # wr_id -> (work, work requests, notify slot, origin rail of its immediate)
        self._inflight: dict[int, tuple[Work, int, int | None, int]] = {}
        self._free_wr = transport.sq_depth
        self._remote_keys = remote_keys
        self._absent: dict[int, float] = {}  # segment id -> until when it is not there
        slot = NOTIFY_HEADER.size + transport.max_notify
        self._notify_mr = device.alloc_mr(transport.notify_slots * slot)
        self._notify_free = list(range(transport.notify_slots))
        self._max_sge = device.max_sge
        self._max_msg = device.max_msg_size
        self.reopen: Callable[[], RdmaRail] | None = None  # this NIC pair, opened again

    @property
    def closed(self) -> bool:
        return self._state != "OPEN"

    @property
    def inflight(self) -> int:
        return len(self._inflight) + len(self._backlog)

    @property
    def free_notify_slots(self) -> int:
        """Notification slots not in use (``notify_slots`` when idle); work that sends
        a notification waits in the backlog while none is free."""
        return len(self._notify_free)

    def learn_segments(self, keys: dict[int, dict[str, Any]]) -> None:
        """Takes remote keys the engine already has (``RemoteSegment.keys["rdma"]``),
        saving the side-channel round trip a first use of a segment costs otherwise."""
        for seg_id, entry in keys.items():
            mr = entry.get("mrs", {}).get(self.remote_device)
            if mr is not None:
                self._remote_keys[int(seg_id)] = MrKey(int(mr[0]), int(mr[1]), int(mr[2]))

    def post(self, work: Work) -> None:
        if self._state == "CLOSED":
            raise ClosedError("rail is closed", peer=self.peer, transport="rdma")
        if self._state == "FAILED":
            raise PeerLostError("rail failed", peer=self.peer, transport="rdma")
        missing = [sid for sid in _segment_ids(work.remote) if sid not in self._remote_keys]
        if missing:  # one round trip per segment, then cached; bounded by the timeout
            self._fetch_keys(sorted(missing))
        with self._lock:  # the state again: the rail may have failed since the check
            if self._state != "OPEN":
                cls = ClosedError if self._state == "CLOSED" else PeerLostError
                raise cls(f"rail {self._state.lower()}", peer=self.peer, transport="rdma")
            self._backlog.append((work, self.index))
            self._pump()

    def holds_remote(self, ids: Sequence[int]) -> bool:
        """Whether the peer has these segments registered on this rail's remote NIC.
        Unknown ones are asked for once; a "not there" is believed for ``ABSENT_S``
        (the peer may register a segment on one more NIC later)."""
        keys = self._remote_keys
        unknown = [sid for sid in ids if sid not in keys]
        if not unknown:
            return True
        now = time.monotonic()
        if any(self._absent.get(sid, 0.0) > now for sid in unknown):
            return False
        try:
            self._fetch_keys(sorted(unknown))
        except TransferError:
            return False  # a broken side channel: the rail is no carrier now
        missing = [sid for sid in unknown if sid not in keys]
        for sid in missing:
            self._absent[sid] = now + ABSENT_S
        return not missing

    def _fetch_keys(self, ids: list[int]) -> None:
        with self._transport.side_lock(self):
            try:
                _send_frame(self._sock, {"kind": "segments", "ids": ids,
                                         "device": self.remote_device})
                reply = _recv_frame(self._sock, self.peer)
            except TimeoutError as exc:
                raise TransferTimeout("segment key lookup timed out", peer=self.peer,
                                      op="connect", transport="rdma") from exc
            except OSError as exc:
                raise PeerLostError(f"side channel failed: {exc}", peer=self.peer,
                                    transport="rdma") from exc
        self._remote_keys.update(_keys_from_wire(reply.get("segments", {})))

    def adopt(self, items: list[tuple[Work, int]], err: TransferError) -> None:
        """Takes over a failed sibling's unfinished work, in order (poller thread). A
        rail that failed meanwhile passes it on (or fails it) rather than keep it."""
        with self._lock:
            if self._state == "OPEN":
                self._backlog.extend(items)
                self._pump()
                return
        self._hand_over(items, err)

    def _specs(self, work: Work, origin: int) -> tuple[WrBatch, int | None]:
        imm = work.imm
        via_send = imm is not None and (imm.notify is not None or origin != self.index
                                        or work.op is Op.READ or imm.first is not None)
        direct = encode_imm(imm.transfer_id, imm.expected) if imm and not via_send else None
        max_sge = self._max_sge if work.op is Op.WRITE else self.device.max_sge_rd
        if work.nbytes == 0 and imm is not None and not work.local and not work.remote:
            specs = empty_batch()  # a notification alone (after a READ): the SEND only
            via_send = True
        else:
            specs = build_wr_batch(
                work.op, work.local, work.remote, local_keys=self._transport.local_keys(
                    self.device.name), remote_keys=self._remote_keys, max_sge=max_sge,
                max_msg_size=self._max_msg, imm=direct, peer=self.peer)
        if not via_send:
            return specs, None
        assert imm is not None
        notify = imm.notify or b""
        if len(notify) > self._transport.max_notify or not self._notify_free:
            if len(notify) > self._transport.max_notify:
                raise ProtocolError(f"notification of {len(notify)} bytes exceeds "
                                    f"max_notify={self._transport.max_notify}",
                                    peer=self.peer, transport="rdma")
            raise BlockingIOError  # no free notify slot yet: stay in the backlog
        slot = self._notify_free.pop()
        size = NOTIFY_HEADER.size + self._transport.max_notify
        data = pack_notify(imm.transfer_id, imm.expected, origin, imm.notify, imm.first)
        self._notify_mr.write(data, len(data), slot * size)
        specs.unsignal_last()
        sge = Sge(self._notify_mr.buf + slot * size, len(data), self._notify_mr.lkey)
        send = WrSpec(Opcode.SEND_WITH_IMM, (sge,), 0, 0, True,
                      encode_imm(imm.transfer_id, imm.expected))
        return specs.append(send), slot

    def _pump(self) -> None:
        """Posts backlog work while the send queue has room (caller holds the lock)."""
        while self._backlog and self._state == "OPEN":
            work, origin = self._backlog[0]
            try:
                specs, slot = self._specs(work, origin)
            except BlockingIOError:
                return
            except TransferError as exc:
                self._backlog.popleft()
                self._transport.defer(self.device, self._on_complete,
                                      Completion(work, exc.with_context(peer=self.peer)))
                continue
            count = len(specs)
            if count > self._transport.sq_depth:
                self._backlog.popleft()
                err = ProtocolError(f"work needs {count} work requests; the send "
                                    f"queue holds {self._transport.sq_depth}",
                                    peer=self.peer, transport="rdma", op=str(work.op))
                self._transport.defer(self.device, self._on_complete, Completion(work, err))
                continue
            if count > self._free_wr:
                if slot is not None:
                    self._notify_free.append(slot)
                return
            self._backlog.popleft()
            wr_id = self._transport.new_wr_id(self)
            self._inflight[wr_id] = (work, count, slot, origin)
            self._free_wr -= count
            try:  # the SEND's entry points at its notify slot (see _specs)
                self.device.post_send(self._qp, wr_id, specs, self.peer)
            except ProtocolError as exc:  # this work's values, not the rail: fail it
                self._inflight.pop(wr_id, None)
                self._free_wr += count
                self._transport.forget_wr_ids([wr_id])
                if slot is not None:
                    self._notify_free.append(slot)
                self._transport.defer(self.device, self._on_complete, Completion(
                    work, exc.with_context(peer=self.peer, op=str(work.op))))
                continue
            except TransferError as exc:
                self._inflight.pop(wr_id, None)
                self._free_wr += count
                self._transport.forget_wr_ids([wr_id])
                self._transport.defer(self.device, self._fail_from, wr_id, exc, work, True,
                                      origin)
                return

    def on_wc(self, wr_id: int, status: int, vendor_err: int) -> None:
        """A send completion for this rail (poller thread)."""
        with self._lock:
            entry = self._inflight.pop(wr_id, None)
            if entry is None:
                return  # flushed after a failure already handled
            work, count, slot, origin = entry
            self._free_wr += count
            if slot is not None:
                self._notify_free.append(slot)
            if status == 0:
                self._pump()
        if status == 0:
            self._on_complete(Completion(work))
            return
        err = wc_error(status, vendor_err, closing=self._state == "CLOSED", peer=self.peer,
                       op=str(work.op), transport="rdma")
        self._fail_from(wr_id, err, work, retry=wc_retryable(status), origin=origin)

    def _fail_from(self, wr_id: int, err: TransferError, culprit: Work | None,
                   retry: bool = True, origin: int | None = None) -> None:
        """The QP is unusable: hand unfinished work to a sibling or fail it.
        ``origin``: the rail the culprit's immediate stands for (this one's if None)."""
        origin = self.index if origin is None else origin
        with self._lock:
            failed = self._state == "OPEN"
            if failed:
                self._state = "FAILED"
            # in posting order, each with the rail its immediate stands for (adopted
            # work keeps its first rail's, so the target counts it once)
            rest = [(w, origin) for _, (w, _, _, origin) in sorted(self._inflight.items())]
            rest += list(self._backlog)
            self._transport.forget_wr_ids(list(self._inflight))
            self._inflight.clear()
            self._backlog.clear()
        self._transport.note_failure(self.peer)
        if failed:
            self._transport.rail_failed(self)
        items = ([(culprit, origin)] if retry and culprit is not None else []) + rest
        if not retry and culprit is not None:
            self._on_complete(Completion(culprit, err))
        self._hand_over(items, err, culprit)

    def _hand_over(self, items: list[tuple[Work, int]], err: TransferError,
                   culprit: Work | None = None) -> None:
        """Moves a failed rail's work to a sibling, or fails it when none is left."""
        if not items:
            return
        sibling = self._transport.sibling(self)
        if sibling is not None and self._state != "CLOSED":
            log.warning("rdma rail %s#%d failed (%s); %d works move to rail #%d",
                        self.peer, self.index, err, len(items), sibling.index)
            sibling.adopt(items, err)
            return
        for work, _ in items:
            self._on_complete(Completion(work, err if work is culprit else PeerLostError(
                "rail failed and no other rdma rail reaches the peer", peer=self.peer,
                op=str(work.op), transport="rdma")))

    def side_alive(self) -> bool:
        """Whether the side channel is still connected (the peer is up)."""
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True  # nothing to read: connected
        except OSError:
            return False

    def fail(self, err: TransferError) -> None:
        """The path is gone (a lost NIC): unfinished work moves to a sibling rail."""
        self._fail_from(0, err, None)

    def close(self) -> None:
        self.abort(None)

    def abort(self, error: TransferError | None) -> None:
        with self._lock:
            if self._state == "CLOSED":
                return
            self._state = "CLOSED"
            pending = [w for w, _, _, _ in self._inflight.values()]
            pending += [w for w, _ in self._backlog]
            self._transport.forget_wr_ids(list(self._inflight))
            self._inflight.clear()
            self._backlog.clear()
        try:
            self._transport.forget_rail(self)
            self._sock.close()
            self.device.destroy_qp(self._qp)  # first: the NIC writes no READ's bytes after
            self._notify_mr.close()
        finally:  # a queue pair that would not go still fails its work
            for work in pending:
                self._on_complete(Completion(work, error or ClosedError(
                    "rail closed", peer=self.peer, op=str(work.op), transport="rdma")))

    def __repr__(self) -> str:
        return (f"<Rail rdma→{self.peer}#{self.index} {self.device.name}→"
                f"{self.remote_device} {self._state} inflight={self.inflight}>")
