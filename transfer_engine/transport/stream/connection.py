"""What a stream target knows of one open rail (:class:`Connection`), and what the
requests waiting on the poller for their peers may hold (:class:`Parking`)."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import numpy as np

from transfer_engine.control.tickets import Ticket
from transfer_engine.transport.iovec import IOVEC_IO
from transfer_engine.transport.stream import pump
from transfer_engine.transport.stream.io import PARK_AFTER, Steps, Wait

__all__ = ["Connection", "Parking", "PARK_BYTES", "PARK_COST", "PARK_PART", "can_park"]

PARK_BYTES = 64 << 20  # memory the requests parked on one server may hold
PARK_COST = 64 << 10  # counted per parked request besides its body and bounce
PARK_PART = 4 << 10  # counted per parked header, entries or body besides their bytes
T = TypeVar("T")


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
        # a request waiting for its peer to move, resumed when it does (land_steps,
        # serve_steps)
        self.parked: Steps | None = None


def can_park(conn: Connection) -> bool:
    """Whether a request on ``conn`` may wait for its peer on the poller."""
    return IOVEC_IO and conn.pump is not None and conn.pump.timed


class Parking:
    """A request that waits for its peer's bytes on the poller frees its worker but
    keeps its memory (a notification body, a bounce): bounded here, so that many
    stalled rails cost no more than the workers they once held. A request that would
    pass the bound waits on its worker, as before (and its peer's pace still ends it)."""

    def __init__(self, limit: int = PARK_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0
        self._lock = threading.Lock()

    def steps(self, steps: Generator[Wait, None, T], costs: Callable[[], int],
              sock: socket.socket, base: int = PARK_COST) -> Generator[Wait, None, T]:
        """``steps`` (and what they return), yielding (parking) only while ``base +
        costs()`` more bytes fit (asked at the first park: most requests never park);
        past that, waiting here for ``sock`` to turn ready, or for the wait's time."""
        cost = -1
        try:
            while True:
                try:
                    wait = next(steps)
                except StopIteration as end:
                    return end.value  # type: ignore[no-any-return]
                if cost < 0:
                    cost = base + costs()
                with self._lock:
                    fits = self.held + cost <= self.limit
                    if fits:
                        self.held += cost
                    else:
                        self.refused += 1
                if not fits:  # waits on this thread (a parked step's calls never do)
                    _ready(sock, wait)
                    continue
                try:
                    yield wait
                finally:
                    with self._lock:
                        self.held -= cost
        finally:
            steps.close()


def _ready(sock: socket.socket, wait: Wait) -> None:
    """Returns once ``sock`` is ready for what ``wait`` waits for (if it watches it),
    at ``wait.until``, or after :data:`~.io.PARK_AFTER` at most (the step then looks
    again)."""
    left = min(PARK_AFTER, wait.until - time.monotonic())
    if left <= 0:
        return
    if not wait.watch:
        time.sleep(left)
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT if wait.writable else select.POLLIN)
    poller.poll(left * 1000)
