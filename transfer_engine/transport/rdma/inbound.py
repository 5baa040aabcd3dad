"""The target side of one RDMA rail: a QP that only receives, and its buffers.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

_RECV_BIT = 1 << 63


class _Inbound:
    """Target side of one rail: a QP that only receives, and its receive buffers."""

    def __init__(self, device: Any, peer: str, rail: int, depth: int, slot: int) -> None:
        # ``device``: the opened NIC, pyverbs' (verbs.Device) or the emulated one
        self.device, self.peer, self.rail = device, peer, rail
        self.origin = b""  # the rail ticket's id: immediates count per connection
        self.side: socket.socket | None = None  # its side channel, shut to cut the peer
        self.qp = device.create_qp(send_wr=1, recv_wr=depth, send_sge=1)
        self.slot = slot
        self._lock = threading.Lock()  # a poller re-posting vs. a side thread closing
        self._closed = False
        try:
            self.mr = device.alloc_mr(depth * slot)
        except BaseException:
            device.destroy_qp(self.qp)
            raise
        self.key = device.qp_key(self.qp)
        try:
            for i in range(depth):
                self.post_recv(i)
        except BaseException:
            self.close()
            raise

    def post_recv(self, index: int) -> None:
        """(Re)posts receive slot ``index``; a no-op once closed (pyverbs would hand a
        destroyed QP's NULL pointer to ``ibv_post_recv``)."""
        with self._lock:
            if not self._closed:
                self.device.post_recv(self.qp, _RECV_BIT | (self.key << 20) | index,
                                      self.mr.buf + index * self.slot, self.slot,
                                      self.mr.lkey, peer=self.peer)

    def payload(self, index: int, nbytes: int) -> bytes:
        return bytes(self.mr.read(nbytes, index * self.slot))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.device.destroy_qp(self.qp)
        self.mr.close()
