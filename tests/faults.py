"""Faults shared by the fault tests: transports that inject them (subclasses of the real
ones) and a peer process frozen on demand."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from transfer_engine.errors import NotSupportedError
from transfer_engine.transport.base import Work
from transfer_engine.transport.shm import ShmServer, ShmTransport
from transfer_engine.transport.stream import Connection, Targets
from transfer_engine.transport.stream.io import recv_into_views
from transfer_engine.transport.tcp import TcpRail, TcpServer, TcpTransport


class RefusingShmServer(ShmServer):
    """Behaves as a kernel that forbids cross-memory attach (EPERM)."""

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        raise NotSupportedError("cross-memory attach refused: Operation not permitted",
                                peer=conn.peer, op="write", transport="shm")


class RefusingShmTransport(ShmTransport):
    """An shm transport whose target side refuses every copy."""

    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        server = self._server
        assert server is not None
        server.__class__ = RefusingShmServer
        return info


class DroppingTcpServer(TcpServer):
    """Resets the connection after ``drop_after`` payload bytes of a WRITE landed."""

    drop_after = 1 << 20

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        budget = self.drop_after
        partial = []
        for v in views:
            if budget <= 0:
                break
            partial.append(v[:budget])
            budget -= len(v)
        recv_into_views(conn.sock, partial)
        linger_zero = b"\x01\x00\x00\x00\x00\x00\x00\x00"
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero)
        conn.sock.close()  # RST: the initiator sees a reset mid-transfer
        raise ConnectionResetError("fault injected: connection dropped")


class DroppingTcpTransport(TcpTransport):
    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        assert self._server is not None
        self._server.__class__ = DroppingTcpServer
        return info


class BrokenPostRail(TcpRail):
    """A rail whose ``post`` fails as a bug would: not with a TransferError."""

    def post(self, work: Work) -> None:
        raise RuntimeError("fault injected: post failed")


class BrokenPostTcpTransport(TcpTransport):
    """A tcp transport whose rails cannot post (see :class:`BrokenPostRail`)."""

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        rail = super().connect(*args, **kwargs)
        rail.__class__ = BrokenPostRail
        return rail


@contextmanager
def stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    """The peer process frozen for the block (its kernel still accepts bytes until its
    socket buffers fill)."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the signal is delivered asynchronously
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                    break
            time.sleep(0.005)
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)
