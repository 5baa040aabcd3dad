"""TCP rails per NIC: which local NIC talks to which remote NIC, and how fast each goes.

A host with several NICs (each with its own address, often its own subnet) gets its
bandwidth only if a peer's TCP rails leave through all of them. The transport binds each
rail's socket to a local NIC's address before connecting to a remote NIC's address.

Pairing: for every remote NIC address, the kernel's routing decides which local address
would be the source (a connected UDP socket's ``getsockname``: nothing is sent). A
remote NIC whose source is one of our NICs pairs with that NIC; our NICs come in the
topology's preference order (:func:`transfer_engine.topology.preferred_nics`), and each
takes the first remote NIC not yet paired that it reaches, so NICs on shared subnets
spread over distinct peers' NICs.

Weights: each rail starts at its link rate (the slower end's) and then follows its
measured goodput, an EWMA of bytes over the time between one completion and the next
while the rail stays busy (or since the work was handed to the socket when it was
idle), so that the planner gives a congested or slower NIC a smaller share.

Return: a NIC rail that broke by itself (its link went down) is opened again on the same
NIC pair in the background (:class:`Reopener`), every ``retry`` seconds while the peer
still has another NIC rail open; the engine takes the new rail in the broken one's place
at its next transfer to that peer (``Transport.revived``). When every NIC rail to a peer
has broken (a link that flapped, a burst of loss that timed each one out), their work
waits a bounded while (:class:`Parking`) for one of the pairs to open again, and is
posted there, rather than failing at once; a peer that refuses the new connection (it
is gone) fails it at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transfer_engine.topology import Topology, load, preferred_nics

__all__ = ["NicEndpoint", "local_nics", "pair_nics", "RateMeter", "StallWatch",
           "Parking", "link_up", "NICS_ENV"]

log = logging.getLogger(__name__)

NICS_ENV = "TE_TCP_NICS"  # "auto" (every active NIC with an address) or "eth0,eth1"


@dataclass(frozen=True)
class NicEndpoint:
    """A NIC a TCP rail can start or end at."""

    name: str
    address: str
    gbps: float = 0.0  # link rate; 0: unknown

    def to_wire(self, port: int) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "port": port,
                "gbps": self.gbps}


def local_nics(spec: str | Sequence[str] | None,
               topology: Topology | None = None) -> list[NicEndpoint]:
    """The NICs to open rails from: ``spec`` is ``"auto"`` (every active NIC of the
    topology that has an address), NIC names, or None (then ``$TE_TCP_NICS``; unset:
    none, so rails leave as the kernel routes them). Raises ValueError for a named NIC
    the topology lacks or that has no address."""
    if spec is None:
        spec = os.environ.get(NICS_ENV) or None
        if spec is None:
            return []
    topo = topology if topology is not None else load()
    order = preferred_nics(topo, "cpu")
    if isinstance(spec, str) and spec == "auto":
        names = [n for n in order if topo.nic(n) is not None and topo.nic(n).address]  # type: ignore[union-attr]
    else:
        names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)
                 if s.strip()]
    out = []
    for name in names:
        nic = topo.nic(name)
        if nic is None or not nic.address:
            raise ValueError(f"NIC {name!r} is not in the topology with an address "
                             f"(have: {[n.name for n in topo.nics if n.address]})")
        out.append(NicEndpoint(name, nic.address, nic.link_rate_gbps))
    return out


def _source_for(address: str) -> str | None:
    """The local address the kernel would send to ``address`` from (None: no route)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))  # UDP connect: a route lookup, no packet
        except OSError:
            return None
        source: str = probe.getsockname()[0]
        return source


def pair_nics(local: Sequence[NicEndpoint], remote: Sequence[dict[str, Any]]
              ) -> list[tuple[NicEndpoint, tuple[str, int], float]]:
    """(local NIC, remote (address, port), link rate in Gb/s) per usable NIC pair, in
    our NICs' order. Remote entries come from the peer's published ``nics``."""
    by_source: dict[str, list[tuple[tuple[str, int], float]]] = {}
    for entry in remote:
        try:
            target = (str(entry["address"]), int(entry["port"]))
            gbps = float(entry.get("gbps", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        source = _source_for(target[0])
        if source is not None:
            by_source.setdefault(source, []).append((target, gbps))
    pairs = []
    used: set[tuple[str, int]] = set()
    for nic in local:
        reach = by_source.get(nic.address, [])
        free = [r for r in reach if r[0] not in used] or reach
        if not free:
            continue
        target, gbps = free[0]
        used.add(target)
        rates = [r for r in (nic.gbps, gbps) if r > 0]
        pairs.append((nic, target, min(rates) if rates else 0.0))
    return pairs


class RateMeter:
    """Goodput of one rail, in Gb/s, as an EWMA over completed work.

    ``started(key)`` when a work is handed to the socket, ``done(key, nbytes)`` when it
    completed. A sample spans from the later of its start and the previous completion
    (the rail was busy with earlier work until then) to now.
    """

    def __init__(self, initial_gbps: float, alpha: float = 0.3) -> None:
        self.gbps = initial_gbps if initial_gbps > 0 else 1.0
        self._alpha = alpha
        self._lock = threading.Lock()
        self._starts: dict[int, tuple[float, int]] = {}  # key -> (start, bytes)
        self._last_done = 0.0
        self.samples = 0

    def started(self, key: int, nbytes: int = 0) -> None:
        with self._lock:
            self._starts[key] = (time.monotonic(), nbytes)

    def overdue(self, grace: float, now: float | None = None) -> float:
        """Seconds the rail has held unfinished work past its due time (0: none): due
        ``grace`` seconds plus four times what the oldest work's bytes take at the
        measured goodput after the later of its start and the last completion."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._starts:
                return 0.0
            start, nbytes = min(self._starts.values())
            since = max(start, self._last_done)
        due = grace + 4 * nbytes * 8 / (self.gbps * 1e9)
        return max(0.0, now - since - due)

    def done(self, key: int, nbytes: int, ok: bool) -> None:
        now = time.monotonic()
        with self._lock:
            started = self._starts.pop(key, None)
            start = started[0] if started is not None else None
            previous, self._last_done = self._last_done, now
            if not ok or start is None or nbytes < (256 << 10):
                return  # small work measures the round trip, not the link
            span = now - max(start, previous)
            if span <= 0:
                return
            sample = nbytes * 8 / span / 1e9
            self.gbps = sample if self.samples == 0 else (
                self._alpha * sample + (1 - self._alpha) * self.gbps)
            self.samples += 1


def link_up(nic: str) -> bool | None:
    """Whether ``nic``'s link has carrier (the kernel's ``/sys/class/net``); None when
    it cannot tell (no such interface here, as for a NIC named by its RDMA device)."""
    try:
        with open(f"/sys/class/net/{nic}/carrier") as f:
            return f.read().strip() == "1"
    except OSError as exc:  # a link set down refuses the read with EINVAL
        return False if os.path.exists(f"/sys/class/net/{nic}") and exc.errno == 22 \
            else None


class StallWatch:
    """Ends NIC rails that cannot carry their work while another rail to the same peer
    is open, so their work moves to the others at once (``rail.stall``): a rail whose
    NIC lost its link (noticed within a tick, where the kernel's ``TCP_USER_TIMEOUT``
    would take ``nic_timeout``, and only for bytes sent), and a rail that holds work
    past its due time (:meth:`RateMeter.overdue`): a NIC that turned lossy or silent
    with its link up slows its share of every transfer without breaking it.

    :param groups: returns the NIC rail groups, one list per peer, when asked.
    :param grace: seconds of no progress allowed past a work's expected time.
    """

    def __init__(self, name: str, groups: Callable[[], list[list[Any]]], grace: float
                 ) -> None:
        self._groups = groups
        self._grace = grace
        self.stalled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"te-{name}-nic-stalls")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self._grace / 4)):
            try:
                self.check()
            except Exception:
                log.exception("NIC stall check failed")

    def check(self) -> None:
        for group in self._groups():
            open_rails = [r for r in group if not r.closed and r.meter is not None]
            if len(open_rails) < 2:
                continue  # nowhere to move its work: slow beats failed
            for rail in open_rails:
                if not any(r is not rail and not r.closed for r in open_rails):
                    break
                late = rail.meter.overdue(self._grace) if rail.inflight else 0.0
                if link_up(rail.nic) is False:
                    reason = f"the link of {rail.nic} is down"
                elif late > 0:
                    reason = f"no progress for {late + self._grace:.1f}s past due"
                else:
                    continue
                self.stalled += 1
                rail.stall(reason)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)


@dataclass(eq=False)
class _Parked:
    work: Any
    rail: Any  # the rail it broke on: settles it when it cannot be posted again
    error: Any  # what it fails with at its deadline
    due: float


class Parking:
    """Work whose peer has no open NIC rail left, held up to ``wait`` seconds for one
    of the peer's NIC pairs to open again (:meth:`take` posts it on the new rail, as a
    failover would: the same bytes at the same place). At its deadline, at
    :meth:`fail` (the peer refused the new connection) or at :meth:`close` it fails,
    through the rail it broke on (``rail.settle``), with the error it was parked with.
    One thread, started while something is parked, keeps the deadlines."""

    def __init__(self, name: str, wait: float) -> None:
        if not wait >= 0:
            raise ValueError("the NIC wait must not be negative")
        self.name = name
        self.wait = wait
        self.parked = 0  # works parked so far
        self.resumed = 0  # of them, posted again on a reopened rail
        self._lots: dict[str, list[_Parked]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def park(self, key: str, rail: Any, work: Any, error: Any) -> bool:
        """Holds ``work`` for peer ``key``; False (not held) when closed or not waiting."""
        with self._cond:
            if self._closed or self.wait <= 0:
                return False
            self._lots.setdefault(key, []).append(
                _Parked(work, rail, error, time.monotonic() + self.wait))
            self.parked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"te-{self.name}-nic-parking")
                self._thread.start()
            self._cond.notify()
        return True

    def waiting(self, key: str) -> bool:
        with self._cond:
            return bool(self._lots.get(key))

    def take(self, key: str, rail: Any) -> None:
        """Posts ``key``'s parked work on ``rail`` (just opened); work it refuses stays
        parked, to its deadline."""
        with self._cond:
            lot = self._lots.pop(key, [])
        kept = []
        for i, parked in enumerate(lot):
            parked.work.resent = True  # its immediate may have been counted already
            try:
                rail.post(parked.work)
            except Exception:  # noqa: BLE001 - the new rail broke too: keep waiting
                kept = lot[i:]
                break
            self.resumed += 1
        if lot and len(kept) < len(lot):
            log.info("%s: %d works posted again on a reopened NIC rail %s->%s", self.name,
                     len(lot) - len(kept), getattr(rail, "nic", None), rail.peer)
        if kept:
            with self._cond:
                self._lots.setdefault(key, [])[:0] = kept

    def fail(self, key: str, reason: str | None = None) -> None:
        """Fails ``key``'s parked work now."""
        with self._cond:
            lot = self._lots.pop(key, [])
        self._settle(lot, reason)

    def _settle(self, lot: list[_Parked], reason: str | None) -> None:
        for parked in lot:
            error = parked.error
            if reason is not None:
                error = type(error)(f"{error.message}; {reason}", **error.context())
            parked.rail.settle(parked.work, error)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._lots:
                    self._thread = None
                    return
                now = time.monotonic()
                due: list[_Parked] = []
                for key in list(self._lots):
                    lot = self._lots[key]
                    due += [p for p in lot if p.due <= now]
                    lot[:] = [p for p in lot if p.due > now]
                    if not lot:
                        del self._lots[key]
                if not due:
                    first = min(p.due for lot in self._lots.values() for p in lot)
                    self._cond.wait(max(0.01, first - now))
                    continue
            self._settle(due, f"no NIC rail opened again within {self.wait:g}s")

    def close(self, error: Callable[[Any], Any]) -> None:
        """Fails everything parked with ``error(parked error)``; parks nothing more."""
        with self._cond:
            self._closed = True
            lots = list(self._lots.values())
            self._lots.clear()
            self._cond.notify()
        for lot in lots:
            for parked in lot:
                parked.rail.settle(parked.work, error(parked.error))
