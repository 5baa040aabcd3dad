"""One thread per engine that ends what must end: transfer deadlines and silent peers.

Deadlines sit in a heap, pushed only for transfers that have one (a transfer without
costs nothing); the thread sleeps until the earliest, or the next probe tick.

Probing: while a peer has transfers in flight for longer than a probe interval, the
thread sends it a cheap control request (``SegmentsRequest``) every interval, on a
socket of its own and without waiting for the answer; any answer proves the peer alive.
A peer that answered nothing for ``peer_timeout`` seconds is reported silent (the engine
declares it lost). Peers without such transfers are not probed and cost no socket.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Container, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from transfer_engine.control.auth import Signer, seal
from transfer_engine.control.messages import SegmentsRequest

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


class _Live(Container[Any], Sized, Protocol):
    """What the watchdog needs of the engine's live transfers: membership and size."""


@dataclass
class _Probe:
    sock: zmq.Socket[bytes]
    address: str
    answered: float  # monotonic time of the last answer (or of the first probe)


class Watchdog:
    """Deadlines and peer probing for one engine.

    :param expire: ``expire(key, detail)`` once a deadline is due (from this thread).
    :param live: the keys of transfers still live; deadlines whose key is gone are
        dropped when the heap grows past twice their number.
    :param stuck: ``stuck(before)`` maps each peer (any hashable) with transfers in
        flight since before the monotonic time ``before`` to its control address.
    :param silent: ``silent(peer, seconds)`` once a probed peer answered nothing for
        ``peer_timeout`` seconds; it is not probed again until it is stuck anew.
    :param peer_timeout: seconds without an answer before a stuck peer is silent;
        ``None`` disables probing.
    """

    def __init__(self, name: str, zctx: zmq.Context[Any], signer: Signer | None, *,
                 expire: Callable[[Any, Any], None], live: _Live,
                 stuck: Callable[[float], dict[Any, str]],
                 silent: Callable[[Any, float], None],
                 peer_timeout: float | None) -> None:
        self._zctx = zctx
        self._signer = signer
        self._expire = expire
        self._live = live
        self._stuck = stuck
        self._silent = silent
        self.peer_timeout = peer_timeout
        # probe every fifth of the timeout (at most 1 s): a live peer gets five chances
        self.interval = (None if peer_timeout is None
                         else max(0.05, min(1.0, peer_timeout / 5)))
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Any, Any]] = []
        self._seq = itertools.count()
        self._probes: dict[Any, _Probe] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"te-watch-{name}")
        self._thread.start()

    def add(self, when: float, key: Any, detail: Any = None) -> None:
        """Calls ``expire(key, detail)`` at monotonic time ``when`` (unless closed)."""
        with self._cond:
            heap = self._heap
            if len(heap) > 1024 and len(heap) > 2 * len(self._live):
                # finished transfers leave their entries behind: drop them now and then
                heap[:] = [e for e in heap if e[2] in self._live]
                heapq.heapify(heap)
            seq = next(self._seq)
            heapq.heappush(heap, (when, seq, key, detail))
            if heap[0][1] == seq:  # the earliest now: the thread sleeps too long
                self._cond.notify()

    def _run(self) -> None:
        next_tick = time.monotonic() + (self.interval or 0.0)
        try:
            while True:
                with self._cond:
                    while not self._stop:
                        now = time.monotonic()
                        wait = None if self.interval is None else next_tick - now
                        if self._heap:
                            due = self._heap[0][0] - now
                            wait = due if wait is None else min(wait, due)
                        if wait is not None and wait <= 0:
                            break
                        self._cond.wait(wait)
                    if self._stop:
                        return
                    now = time.monotonic()
                    items = []
                    while self._heap and self._heap[0][0] <= now:
                        items.append(heapq.heappop(self._heap)[2:])
                for key, detail in items:
                    try:
                        self._expire(key, detail)
                    except Exception:
                        log.exception("deadline handling failed")
                if self.interval is not None and now >= next_tick:
                    try:
                        self._probe(now)
                    except Exception:
                        log.exception("peer probing failed")
                    next_tick = time.monotonic() + self.interval
        finally:
            for probe in self._probes.values():
                probe.sock.close(linger=0)
            self._probes.clear()

    def _probe(self, now: float) -> None:
        assert self.interval is not None and self.peer_timeout is not None
        stuck = self._stuck(now - self.interval)
        for peer in list(self._probes):
            if stuck.get(peer) != self._probes[peer].address:
                self._probes.pop(peer).sock.close(linger=0)
        request = seal(SegmentsRequest(""), self._signer)
        for peer, address in stuck.items():
            probe = self._probes.get(peer)
            if probe is None:
                probe = self._probes[peer] = _Probe(self._open(address), address, now)
            while True:  # any answer (even a refusal) proves the peer alive
                try:
                    probe.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                probe.answered = now
            silence = now - probe.answered
            if silence >= self.peer_timeout:
                self._probes.pop(peer).sock.close(linger=0)
                self._silent(peer, silence)
                continue
            try:
                probe.sock.send(request, zmq.NOBLOCK)
            except zmq.Again:  # a few unanswered probes already queued: enough
                pass

    def _open(self, address: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
        sock.connect(address)
        return sock

    def close(self) -> None:
        """Stops the thread and closes its probe sockets. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def probing(self) -> int:
        """Peers being probed now."""
        return len(self._probes)
