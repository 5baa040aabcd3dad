"""Raw addresses to segments: Mooncake names memory by virtual address, we by (segment,
offset). Memory registered here is a segment named ``mc:<hex base address>``
(:data:`SEGMENT_PREFIX`), so a peer maps an address to the segment holding it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from transfer_engine.peer import Peer

__all__ = ["SEGMENT_PREFIX", "AddressMap", "remote_map"]

SEGMENT_PREFIX = "mc:"  # mc:<hex base address>: how a peer maps raw addresses


class AddressMap:
    """Sorted ``(base, end, segment)`` ranges: which segment holds an address."""

    def __init__(self, ranges: Sequence[tuple[int, int, Any]] = ()) -> None:
        self._ranges = sorted(ranges, key=lambda r: r[0])
        self._bases = [r[0] for r in self._ranges]

    def find(self, address: int, length: int) -> tuple[Any, int] | None:
        """The segment containing ``[address, address + length)`` and the offset."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            return None
        base, end, seg = self._ranges[i]
        if address + length > end:
            return None
        return seg, address - base

    def overlaps(self, address: int, length: int) -> bool:
        end = address + length
        i = bisect.bisect_left(self._bases, end) - 1
        return i >= 0 and self._ranges[i][1] > address

    def first(self) -> Any | None:
        """The segment registered first."""
        return min((r[2] for r in self._ranges), key=lambda s: s.id, default=None)


def remote_map(peer: Peer) -> AddressMap:
    ranges = []
    for seg in peer.segments.values():
        if seg.name.startswith(SEGMENT_PREFIX):
            try:
                base = int(seg.name[len(SEGMENT_PREFIX):], 16)
            except ValueError:
                continue
            ranges.append((base, base + seg.length, seg))
    return AddressMap(ranges)
