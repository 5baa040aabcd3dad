"""What a stream target knows of one open rail (:class:`Connection`)."""

from __future__ import annotations

import socket
from collections.abc import Generator
from typing import Any

import numpy as np

from transfer_engine.control.tickets import Ticket
from transfer_engine.transport.stream import pump

__all__ = ["Connection"]


class Connection:
    """What the target knows of one open rail: the peer its ticket names (never what
    its messages say), that peer's process, what the rail has pinned right now, and the
    initiator ranges it announced (shm)."""

    __slots__ = ("sock", "peer", "pid", "ticket", "pinned", "ranges", "pidfd", "pump", "busy",
                 "devices", "parked")

    def __init__(self, sock: socket.socket, peer: str, pid: int,
                 ticket: Ticket | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.pid = pid
        self.ticket = ticket
        self.pinned: list[Any] = []
        self.ranges: np.ndarray | None = None  # (start, end, writable) rows, sorted
        self.pidfd: int | None = None
        self.pump: pump.Pump | None = None  # serves the rail once it is open
        self.busy = False  # a pump worker is serving it (else the pump watches it)
        self.devices: Any = None  # the initiator's device segments (shm IPC)
        # a request waiting for its peer's bytes, resumed when they come (land_steps)
        self.parked: Generator[float, None, None] | None = None
