"""Expiry in time layers, and CLOCK reclamation when memory runs short.

Expiry: a deadline ``d`` goes into layer ``floor(d / granularity)``, a plain list, so adding
is O(1). :meth:`ExpiryLayers.pop_due` walks layers in time order (a heap of layer ids) and
stops at the first layer that starts after ``now``: layers that ended wholly before ``now``
are emptied in one sweep; the one layer that straddles ``now`` is heapified once and popped
entry by entry. The work is proportional to what expires plus one partial layer, never to
what is stored. Entries are not removed on overwrite or delete (that would need a search);
the store checks each popped ``(key, deadline)`` against the deadline in the record and
drops stale ones, so each entry is paid for once.

Expiry is exact without waiting for a sweep: the record carries its deadline and every
lookup treats ``now >= deadline`` as a miss. Sweeps only give the memory back.

Reclamation: CLOCK over the index slots, using the reference bit the index sets on each
hit (:attr:`kvstore.index.CuckooIndex.ref`). The hand sweeps slots in order; an occupied
slot with its bit set gets a second chance (the bit is cleared), one with the bit clear is
a victim. The sweep is vectorised over windows of slots. Entries in the index stash are
not swept (there are at most a handful).
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgumentError
from kvstore.index import CuckooIndex

__all__ = ["ExpiryLayers", "ClockReclaimer"]


class ExpiryLayers:
    """Deadlines grouped into layers of ``granularity`` seconds.

    Parameters:
        granularity: layer width in seconds (> 0). Wider layers mean fewer layers to
            walk; the partly expired layer costs at most its size once.
    """

    def __init__(self, granularity: float = 1.0) -> None:
        if not (granularity > 0 and math.isfinite(granularity)):
            raise InvalidArgumentError(
                f"granularity must be a finite number > 0, not {granularity}"
            )
        self.granularity = float(granularity)
        self._layers: dict[int, list[tuple[float, int]]] = {}
        self._heaped: set[int] = set()
        self._order: list[int] = []  # heap of layer ids
        self._size = 0

    def __len__(self) -> int:
        """Entries waiting, stale ones included."""
        return self._size

    def __repr__(self) -> str:
        return f"<ExpiryLayers layers={len(self._layers)} entries={self._size}>"

    def add(self, key: int, deadline: float) -> None:
        """Schedules ``key`` to be checked at ``deadline`` (ignored when infinite)."""
        if not math.isfinite(deadline):
            return
        self._insert(math.floor(deadline / self.granularity), deadline, key)
        self._size += 1

    def _insert(self, lid: int, deadline: float, key: int) -> None:
        layer = self._layers.get(lid)
        if layer is None:
            layer = self._layers[lid] = []
            heapq.heappush(self._order, lid)
        if lid in self._heaped:
            heapq.heappush(layer, (deadline, key))
        else:
            layer.append((deadline, key))

    def pop_due(self, now: float) -> list[tuple[int, float]]:
        """Removes and returns ``(key, deadline)`` for every deadline ``<= now``."""
        out: list[tuple[int, float]] = []
        g = self.granularity
        while self._order:
            lid = self._order[0]
            if lid * g > now:
                break
            layer = self._layers[lid]
            if lid not in self._heaped and (lid + 1) * g <= now:
                # wholly past: one sweep, no ordering needed
                out.extend((k, d) for d, k in layer if d <= now)
                rest = [(d, k) for d, k in layer if d > now]
            else:
                if lid not in self._heaped:
                    heapq.heapify(layer)
                    self._heaped.add(lid)
                while layer and layer[0][0] <= now:
                    d, k = heapq.heappop(layer)
                    out.append((k, d))
                rest = layer
                if rest and (lid + 1) * g > now:
                    break  # the layer straddling now; later layers start after it
            del self._layers[lid]
            self._heaped.discard(lid)
            heapq.heappop(self._order)
            for d, k in rest:  # float rounding stragglers: check them one layer later
                self._insert(lid + 1, d, k)
        self._size -= len(out)
        return out

    def next_deadline(self) -> float | None:
        """Earliest pending deadline (stale entries included), or None."""
        if not self._order:
            return None
        return min(d for d, _ in self._layers[self._order[0]])

    def clear(self) -> None:
        self._layers.clear()
        self._heaped.clear()
        self._order.clear()
        self._size = 0


class ClockReclaimer:
    """Chooses eviction victims among the index's slots with CLOCK.

    Parameters:
        index: the index whose occupancy (:meth:`~kvstore.index.CuckooIndex.occupied`)
            and ``ref`` bits are swept.
        window: slots examined per vectorised step.
    """

    def __init__(self, index: CuckooIndex, *, window: int = 4096) -> None:
        self._index = index
        self.window = window
        self.hand = 0

    def __repr__(self) -> str:
        return f"<ClockReclaimer hand={self.hand}/{self._index.slots}>"

    def select(self, count: int) -> npt.NDArray[np.int64]:
        """Up to ``count`` victims (flat slot positions) in hand order, sweeping at most one
        full turn. Reference bits of slots passed over are cleared; the hand stops just
        after the last victim. The caller removes the victims; fewer than ``count`` come
        back only when one turn found no more unreferenced entries (call again: the bits
        are clear now)."""
        index = self._index
        total = index.slots
        ref = index.ref.reshape(-1)  # contiguous: a view, so clearing bits below sticks
        out: list[npt.NDArray[np.int64]] = []
        need = count
        scanned = 0
        while need > 0 and scanned < total:
            start = self.hand
            end = min(start + self.window, start + total - scanned, total)
            r = ref[start:end]
            cand = np.flatnonzero(index.occupied(start, end) & (r == 0))
            if cand.size >= need:
                last = int(cand[need - 1])
                r[: last + 1] = 0
                out.append(start + cand[:need])
                self.hand = (start + last + 1) % total
                need = 0
            else:
                r[:] = 0
                out.append(start + cand)
                need -= int(cand.size)
                self.hand = end % total
            scanned += end - start
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
