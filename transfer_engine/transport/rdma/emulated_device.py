"""The RDMA transport's device on the emulated verbs provider (``provider="emulated"``).

It has the interface of ``verbs.Device`` — queue pairs, memory registration,
posting, the completion thread — over the objects of ``emulated``, so the
transport's rail, protocol and failover code runs unchanged on a machine without a NIC.
Errors of the emulated verbs calls are translated here, once, as ``verbs.translate``
does for pyverbs.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from transfer_engine.errors import (
    ConnectError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferError,
)
from transfer_engine.transport.rdma.emulated import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    CompletionQueue,
    MemoryRegion,
    Nic,
    ProtectionDomain,
    QpState,
    QueuePair,
    VerbsError,
    WorkCompletion,
)
from transfer_engine.transport.rdma.placement import RouteSettings
from transfer_engine.transport.rdma.plan import CqRoom, QpInfo, WrSpec

if TYPE_CHECKING:
    from transfer_engine.transport.rdma.inbound import _Inbound

__all__ = ["EmulatedDevice", "open_devices", "DEFAULT_NAMES"]

log = logging.getLogger("transfer_engine.transport.rdma")

DEFAULT_NAMES = ("emu0", "emu1")
_POLL_BATCH = 64


@contextmanager
def translate(cls: type[TransferError], what: str, **ctx: Any) -> Iterator[None]:
    """Emulated verbs errors become ours, errno in the message."""
    try:
        yield
    except VerbsError as exc:
        raise cls(f"{what} failed: {exc}", transport="rdma", **ctx) from exc


class EmulatedDevice:
    """One emulated NIC opened for the transport: PD, one CQ and its completion thread."""

    port = 1
    lid = 0
    gid_index = 0

    def __init__(self, name: str, *, route: RouteSettings | None = None, cq_depth: int,
                 relaxed_ordering: bool = False, on_wc: Any,
                 poll_interval: float = 0.2, copy: bool = True,
                 on_event: Callable[[EmulatedDevice, int], None] | None = None) -> None:
        self.name, self.route = name, route or RouteSettings()  # one fabric: no routes
        self.nic = Nic(name, copy=copy)
        self.gid = self.nic.gid
        self.mtu = Nic.mtu
        self.max_msg_size = Nic.max_msg_size
        self.max_sge = min(Nic.max_sge, 30)
        self.max_sge_rd = min(Nic.max_sge_rd, 30)
        self.max_rd_atomic = self.max_init_rd_atomic = 16
        self.cq_depth = min(cq_depth, Nic.max_cqe)
        self.link_rate_gbps = 0.0
        self.pd = ProtectionDomain(self.nic)
        self.cq = CompletionQueue(self.nic, self.cq_depth)
        self.cq_room = CqRoom(self.cq_depth)
        self._on_wc, self._interval, self._on_event = on_wc, poll_interval, on_event
        self._inbound: dict[int, _Inbound] = {}
        self._calls: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self.nic.on_event = lambda: self.call_soon(self._events)
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"te-rdma-cq-{name}",
                                        daemon=True)
        self._thread.start()

    # QPs and memory

    def create_qp(self, *, send_wr: int, recv_wr: int, send_sge: int) -> QueuePair:
        """A QP in INIT with its room reserved on the CQ (see ``plan.CqRoom``)."""
        self.cq_room.reserve(send_wr + recv_wr, self.name)
        try:
            with translate(ConnectError, f"creating a queue pair on {self.name}"):
                qp = QueuePair(self.pd, self.cq, max_send_wr=send_wr,
                               max_recv_wr=recv_wr, max_send_sge=send_sge)
                try:
                    qp.to_init(self.port, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
                               | ACCESS_REMOTE_READ)
                except VerbsError:
                    qp.close()
                    raise
        except BaseException:
            self.cq_room.cancel(send_wr + recv_wr)
            raise
        self.cq_room.hold(id(qp), send_wr + recv_wr)
        return qp

    def destroy_qp(self, qp: QueuePair) -> None:
        try:
            qp.close()
        finally:
            self.cq_room.free(id(qp))

    @staticmethod
    def qp_key(qp: QueuePair) -> int:
        return qp.qp_num

    def qp_info(self, qp: QueuePair, psn: int) -> QpInfo:
        return QpInfo(qp.qp_num, self.lid, self.gid, self.gid_index, psn, self.mtu,
                      self.name, self.port)

    def connect_qp(self, qp: QueuePair, psn: int, theirs: QpInfo, mtu: int,
                   peer: str | None = None) -> None:
        with translate(ConnectError, f"connecting queue pair on {self.name}", peer=peer,
                       op="connect"):
            qp.to_rtr(theirs.gid, theirs.qp_num)
            qp.to_rts()

    def alloc_mr(self, length: int) -> MemoryRegion:
        with translate(RegistrationError, f"allocating a {length}-byte buffer"):
            return MemoryRegion(self.pd, length, ACCESS_LOCAL_WRITE)

    def register(self, address: int, length: int, device: str, *, writable: bool,
                 segment: str) -> tuple[MemoryRegion, int]:
        if device != "cpu":
            raise RegistrationError(f"the emulated NIC {self.name} reaches host memory "
                                    f"only, not {device}", transport="rdma",
                                    segment=segment, length=length)
        access = (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ
                  if writable else ACCESS_REMOTE_READ)
        with translate(RegistrationError, f"memory registration on {self.name}",
                       segment=segment, length=length):
            return MemoryRegion(self.pd, length, access, address=address), address

    # posting

    def post_send(self, qp: QueuePair, wr_id: int, specs: Sequence[WrSpec],
                  peer: str | None = None) -> None:
        """A chain of requests under one doorbell. ``ProtocolError`` for requests the
        queue pair refuses (the work's fault), ``PeerLostError`` otherwise."""
        try:
            qp.post_send(wr_id, specs)
        except VerbsError as exc:
            refused = exc.error_code == errno.EINVAL and qp.state == QpState.RTS
            cls = ProtocolError if refused else PeerLostError
            raise cls(f"ibv_post_send failed: {exc}", transport="rdma", peer=peer) from exc

    def post_recv(self, qp: QueuePair, wr_id: int, addr: int, length: int, lkey: int,
                  peer: str | None = None) -> None:
        with translate(ConnectError, f"posting a receive on {self.name}", peer=peer):
            qp.post_recv(wr_id, [(addr, length, lkey)])

    # inbound QPs, deferred calls, completions

    def add_inbound(self, conn: _Inbound) -> None:
        self._inbound[conn.key] = conn

    def remove_inbound(self, conn: _Inbound) -> None:
        self._inbound.pop(conn.key, None)

    def inbound(self, key: int) -> _Inbound | None:
        return self._inbound.get(key)

    def call_soon(self, fn: Any, *args: Any) -> None:
        self._calls.append((fn, args))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def fail(self) -> None:
        """Loses this NIC (tests): every QP to ERR, a ``DEVICE_FATAL`` event."""
        self.nic.fail()

    def _events(self) -> None:
        while self.nic.events:
            kind, _ = self.nic.events.popleft()
            if self._on_event is not None:
                self._on_event(self, kind)

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(self.cq.fd, select.POLLIN)
        timeout = int(self._interval * 1000)
        while not self._stopping:
            try:
                self._drain()
                while self._calls:
                    fn, args = self._calls.popleft()
                    fn(*args)
                for fd, _ in poller.poll(timeout):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    else:
                        self.cq.clear_channel()
            except VerbsError as exc:
                log.error("rdma completion thread of %s: %s", self.name, exc)
                self._stopping = self._stopping or self.cq.overrun
            except Exception:
                log.exception("rdma completion callback failed")

    def _drain(self) -> None:
        for _ in range(1 << 12):  # bounded: the wake-up loop comes round again
            wcs = self.cq.poll(_POLL_BATCH)
            for wc in wcs:
                self._handle(wc)
            if len(wcs) < _POLL_BATCH:
                return

    def _handle(self, wc: WorkCompletion) -> None:
        try:
            self._on_wc(self, wc)
        except Exception:  # one handler's failure must not drop the rest of the batch
            log.exception("rdma completion of wr_id %#x failed", wc.wr_id)

    def stop(self) -> None:
        self._stopping = True
        self.call_soon(lambda: None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self.nic.close()
        self.cq.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def open_devices(names: list[str] | None, **kwargs: Any) -> list[EmulatedDevice]:
    """Opens emulated NICs by name (``emu0``, ``emu1`` when None)."""
    names = list(names or DEFAULT_NAMES)
    if len(set(names)) != len(names) or not all(names):
        raise NotSupportedError(f"emulated RDMA device names must be distinct: {names}",
                                transport="rdma")
    devices: list[EmulatedDevice] = []
    try:
        for name in names:
            devices.append(EmulatedDevice(name, **kwargs))
    except BaseException:
        for dev in devices:
            dev.close()
        raise
    return devices
