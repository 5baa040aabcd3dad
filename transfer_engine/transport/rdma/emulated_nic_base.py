"""What an emulated NIC is apart from the protocol it speaks: its limits, its tables of
memory regions and queue pairs (keys and queue pair numbers), its asynchronous events
and failure, and its wires (accepting, flushing and closing the connections its
thread polls)."""

from __future__ import annotations

import collections
import errno
import itertools
import os
import secrets
import select
import socket
import threading
from collections.abc import Callable

from transfer_engine.transport.rdma.emulated_objects import MemoryRegion, QueuePair, Wire
from transfer_engine.transport.rdma.emulated_types import MAX_MSG, AsyncEvent, VerbsError
from transfer_engine.transport.rdma.emulated_wire import wire_name
from transfer_engine.transport.shm import cross_copy, peer_credentials

__all__ = ["NicBase"]


class NicBase:
    """The tables, events and wires of one emulated RDMA device; its thread and the
    protocol it runs are :class:`~transfer_engine.transport.rdma.emulated.Nic`'s."""

    max_qp_wr = 16384
    max_sge = 30
    max_sge_rd = 30
    max_cqe = 1 << 20
    max_msg_size = MAX_MSG
    mtu = 4096

    def __init__(self, name: str, *, copy: bool = True, rnr_timeout: float = 2.0) -> None:
        self._copy_fn = cross_copy
        self.name, self.copy, self.rnr_timeout = name, copy, rnr_timeout
        self.gid = "fe80:0000:0000:0000:" + ":".join(secrets.token_hex(2) for _ in range(4))
        self.lock = threading.RLock()
        self.qps: dict[int, QueuePair] = {}
        self.mrs: dict[int, MemoryRegion] = {}
        self.pending: set[QueuePair] = set()
        self.stalled: set[Wire] = set()
        self.events: collections.deque[tuple[int, int | None]] = collections.deque()
        self.on_event: Callable[[], None] | None = None
        self.failed = False
        self.bytes_moved = 0  # as responder (counted in counting mode too)
        self.wrs_issued = 0  # send requests this NIC sent as requester
        self._keys = itertools.count(secrets.randbelow(1 << 20) + 1)
        self._qpns = itertools.count(secrets.randbelow(1 << 16) + 16)
        self._wires: dict[int, Wire] = {}  # fd -> wire
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(wire_name(self.gid))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)
        self._poller.register(self._listener, select.POLLIN)
        self._stopping = False

    # tables (lock held by callers or taken here)

    def new_key(self) -> int:
        return next(self._keys) & 0xFFFFFFFF

    def new_qp_num(self) -> int:
        return next(self._qpns) & 0xFFFFFF

    def add_mr(self, mr: MemoryRegion) -> None:
        with self.lock:
            self.mrs[mr.lkey] = mr

    def remove_mr(self, mr: MemoryRegion) -> None:
        with self.lock:
            self.mrs.pop(mr.lkey, None)

    def add_qp(self, qp: QueuePair) -> None:
        with self.lock:
            if self.failed:
                raise VerbsError("ibv_create_qp (device failed)", errno.EIO)
            self.qps[qp.qp_num] = qp

    def remove_qp(self, qp: QueuePair) -> None:
        self.qps.pop(qp.qp_num, None)
        self.pending.discard(qp)

    def raise_event(self, kind: int, element: int | None) -> None:
        self.events.append((kind, element))
        if self.on_event is not None:
            self.on_event()

    def doorbell(self) -> None:
        try:
            os.eventfd_write(self._bell, 1)
        except OSError:
            pass

    def fail(self) -> None:
        """Loses the device (a NIC pulled, a fatal firmware error): ``DEVICE_FATAL``
        and every queue pair in ERR with its work flushed."""
        with self.lock:
            self.failed = True
            cqs = set()
            for qp in list(self.qps.values()):
                qp.to_error()
                cqs.add(qp.cq)
            for cq in cqs:
                cq.signal()
            self.raise_event(AsyncEvent.DEVICE_FATAL, None)
        self.doorbell()

    def drop_wire(self, wire: Wire) -> None:
        """Closes a wire from any thread: the NIC thread notices on its next round."""
        try:
            wire.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.doorbell()

    # wires (NIC thread)

    def _reap(self) -> None:
        """Closes wires of destroyed queue pairs (lock held)."""
        for wire in list(self._wires.values()):
            qp = wire.qp
            if qp is not None and qp.qp_num not in self.qps:
                self._close_wire(wire)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            wire = Wire(sock, None, responder=True)
            wire.pid = peer_credentials(sock)[0]
            self._add_wire(wire)

    def _add_wire(self, wire: Wire) -> None:
        self._wires[wire.sock.fileno()] = wire
        self._poller.register(wire.sock, select.POLLIN)

    def _close_wire(self, wire: Wire) -> None:
        fd = wire.sock.fileno()
        if fd >= 0:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
            self._wires.pop(fd, None)
        wire.sock.close()
        self.stalled.discard(wire)

    def _flush(self, wire: Wire) -> None:
        try:
            n = wire.sock.send(wire.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            wire.out.clear()
            return
        del wire.out[:n]
        if wire.sock.fileno() >= 0:
            mask = select.POLLIN | (select.POLLOUT if wire.out else 0)
            try:
                self._poller.modify(wire.sock, mask)
            except (KeyError, ValueError, OSError):
                pass
