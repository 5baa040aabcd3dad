"""Per-peer transport choice and health: pure logic, no sockets, injectable clock.

- :func:`negotiate` picks, from both sides' handshake metadata, the transports a pair of
  engines can use, best first: ``shm`` on the same host, ``rdma`` when both have active
  devices on a shared fabric, then ``tcp``.
- :class:`PeerHealth` keeps, per transport, a latency EWMA and error counts. After
  ``demote_after`` consecutive failures a transport is demoted (moved behind the others)
  and becomes due for a re-probe ``reprobe_after`` seconds later; a failed probe doubles
  the delay (up to ``max_reprobe``), a successful one restores the transport.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["negotiate", "TransportState", "TransportHealth", "PeerHealth"]

PREFERENCE = ("shm", "rdma", "tcp")


def _fabrics(info: Any) -> set[str]:
    """Fabric ids an rdma transport publishes (``devices``: names or maps with
    ``fabric``/``subnet_prefix``/``gid`` fields); a bare device name counts as the
    default fabric."""
    out = set()
    for dev in (info or {}).get("devices") or []:
        if isinstance(dev, Mapping):
            if dev.get("state", "active") not in ("active", 4, "PORT_ACTIVE"):
                continue
            fabric = dev.get("fabric") or dev.get("subnet_prefix") or "default"
            out.add(str(fabric))
        elif dev:
            out.add("default")
    return out


def negotiate(local: Mapping[str, Any], remote: Mapping[str, Any],
              available: Iterable[str] | None = None) -> list[str]:
    """Transports both sides can use for this pair, best first.

    ``local``/``remote`` are handshake metadata (``Engine.metadata()``): ``host_id`` and
    ``transports`` (name -> endpoint info). ``available`` limits the choice to the
    transports this engine actually runs; unknown names keep their relative order after
    the known ones.
    """
    mine: Mapping[str, Any] = local.get("transports") or {}
    theirs: Mapping[str, Any] = remote.get("transports") or {}
    names = [n for n in (available if available is not None else mine) if n in theirs
             and n in mine]
    out = []
    for name in names:
        if name == "shm":
            lhost = (mine.get("shm") or {}).get("host_id") or local.get("host_id")
            rhost = (theirs.get("shm") or {}).get("host_id") or remote.get("host_id")
            if not lhost or lhost != rhost:
                continue
        elif name == "rdma" and not (_fabrics(mine.get("rdma")) & _fabrics(theirs.get("rdma"))):
            continue
        out.append(name)
    rank = {n: i for i, n in enumerate(PREFERENCE)}
    return sorted(out, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


class TransportState(enum.Enum):
    HEALTHY = "healthy"
    DEMOTED = "demoted"  # behind the others; re-probed when due
    PROBING = "probing"  # one probe in flight


@dataclass
class TransportHealth:
    name: str
    state: TransportState = TransportState.HEALTHY
    latency: float | None = None  # EWMA of seconds per operation
    successes: int = 0
    errors: int = 0
    consecutive: int = 0  # failures since the last success
    demotions: int = 0
    reprobe_at: float = 0.0
    backoff: float = 0.0


class PeerHealth:
    """Health of one peer's transports; not thread-safe (the owner holds a lock).

    :param transports: negotiated transports, best first.
    :param demote_after: consecutive failures that demote a transport.
    :param reprobe_after: seconds before a demoted transport is tried again.
    :param max_reprobe: upper bound of the doubled re-probe delay, seconds.
    :param alpha: weight of a new latency sample in the EWMA.
    :param clock: monotonic seconds.
    """

    def __init__(self, transports: Sequence[str], *, demote_after: int = 3,
                 reprobe_after: float = 5.0, max_reprobe: float = 300.0, alpha: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if demote_after < 1 or reprobe_after <= 0 or not 0 < alpha <= 1:
            raise ValueError("demote_after >= 1, reprobe_after > 0, 0 < alpha <= 1")
        self._preference = list(transports)
        self._health = {t: TransportHealth(t) for t in transports}
        self.demote_after = demote_after
        self.reprobe_after = reprobe_after
        self.max_reprobe = max_reprobe
        self.alpha = alpha
        self._clock = clock

    def __getitem__(self, transport: str) -> TransportHealth:
        return self._health[transport]

    def add(self, transport: str) -> None:
        if transport not in self._health:
            self._preference.append(transport)
            self._health[transport] = TransportHealth(transport)

    def order(self) -> list[str]:
        """Transports to use, best first: healthy and probing ones in preference order,
        then demoted ones, the one due for a re-probe soonest first."""
        up = [t for t in self._preference if self._health[t].state is not
              TransportState.DEMOTED]
        down = sorted((t for t in self._preference if t not in up),
                      key=lambda t: self._health[t].reprobe_at)
        return up + down

    def record_success(self, transport: str, latency: float | None = None) -> None:
        h = self._health[transport]
        h.successes += 1
        h.consecutive = 0
        if latency is not None:
            h.latency = latency if h.latency is None else (
                self.alpha * latency + (1 - self.alpha) * h.latency)
        if h.state is not TransportState.HEALTHY:
            h.state = TransportState.HEALTHY
            h.backoff = 0.0

    def record_failure(self, transport: str, *, force: bool = False) -> bool:
        """Counts a failure; returns True when it demoted the transport just now.
        ``force`` demotes at once (a failure that already made a transfer fail over)."""
        h = self._health[transport]
        h.errors += 1
        h.consecutive += 1
        if h.state is TransportState.PROBING:
            h.backoff = min(h.backoff * 2, self.max_reprobe)
            self._demote(h)
            return True
        if h.state is TransportState.HEALTHY and (force or
                                                  h.consecutive >= self.demote_after):
            h.backoff = self.reprobe_after
            self._demote(h)
            return True
        return False

    def _demote(self, h: TransportHealth) -> None:
        h.state = TransportState.DEMOTED
        h.demotions += 1
        h.reprobe_at = self._clock() + h.backoff

    def due(self) -> list[str]:
        """Demoted transports whose re-probe time has come, best first. Each is marked
        PROBING: the caller tries it once and reports the outcome."""
        now = self._clock()
        out = [t for t in self._preference if self._health[t].state is
               TransportState.DEMOTED and self._health[t].reprobe_at <= now]
        for t in out:
            self._health[t].state = TransportState.PROBING
        return out

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {t: {"state": h.state.value, "latency": h.latency, "errors": h.errors,
                    "consecutive": h.consecutive, "demotions": h.demotions}
                for t, h in self._health.items()}

    def __repr__(self) -> str:
        parts = ",".join(f"{t}:{h.state.value}" for t, h in self._health.items())
        return f"<PeerHealth {parts}>"
