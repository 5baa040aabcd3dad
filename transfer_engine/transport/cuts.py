"""Cutting one peer off a target: what a transport's server remembers of the cut, so
that a rail admitted before it cannot slip in after it (``Engine.cut_peer``)."""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["Cuts", "Teardown", "wait_until", "shut"]

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096  # peers whose latest cut a server remembers


class Cuts:
    """A server's cuts, in order. An opening takes a :meth:`mark` before its ticket is
    checked; a rail whose peer was cut after that mark is refused, though its ticket
    was good when it was checked (the cut revoked it since)."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._seq = 0
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def mark(self) -> int:
        with self._lock:
            return self._seq

    def cut(self, peer: str) -> None:
        with self._lock:
            self._seq += 1
            self._last[peer] = self._seq
            self._last.move_to_end(peer)
            while len(self._last) > self._limit:
                self._last.popitem(last=False)

    def since(self, peer: str, mark: int) -> bool:
        """Whether ``peer`` was cut after ``mark`` was taken."""
        with self._lock:
            return self._last.get(peer, 0) > mark


class Teardown:
    """Mixed into a stream server: tearing down the rails that hold a closing segment,
    or all of one peer's."""

    if TYPE_CHECKING:
        transport_name: str
        cuts: Cuts
        stats: collections.Counter[str]
        _lock: threading.Lock
        _open: dict[socket.socket, Any]  # open rails' Connections

    def revoke(self, segment: Any) -> int:
        """Tears down the rails that hold ``segment`` pinned mid-request (its owner is
        closing it and the peer stalls), so that their pins drop; returns how many. What
        a torn WRITE leaves: a prefix of its bytes may have landed; no immediate was
        counted; the initiator's transfer fails."""
        with self._lock:
            stuck = [c for c in self._open.values() if any(p is segment for p in c.pinned)]
        for conn in stuck:
            log.warning("%s rail from %s torn down: segment %s is closing", self.transport_name,
                        conn.peer, segment.name)
        shut([conn.sock for conn in stuck])
        return len(stuck)

    def cut(self, peer: str, timeout: float) -> bool:
        """Closes every rail of ``peer`` (its tickets already revoked) and waits up to
        ``timeout`` for the requests being served on them to stop; True once none is
        left. A torn WRITE may leave a prefix of its bytes; nothing lands after."""
        self.cuts.cut(peer)
        with self._lock:
            socks = [s for s, c in self._open.items() if c.peer == peer]
        shut(socks)  # served or watched, a rail's worker drops it
        if socks:
            log.info("%s: %d rails of %s cut", self.transport_name, len(socks), peer)
            self.stats["rails_cut"] += len(socks)

        def gone() -> bool:
            with self._lock:
                return not any(s in self._open for s in socks)
        return wait_until(gone, timeout)


def shut(socks: list[socket.socket]) -> None:
    """Shuts ``socks`` both ways: whoever reads or writes them next fails at once."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def wait_until(done: Callable[[], bool], timeout: float) -> bool:
    """Polls ``done`` every millisecond or two until it holds or ``timeout`` passes;
    returns its last answer."""
    end = time.monotonic() + max(timeout, 0.0)
    pause = 0.0005
    while not done():
        if time.monotonic() >= end:
            return done()
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return True
