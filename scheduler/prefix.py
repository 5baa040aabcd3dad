"""Where prefixes are cached: per-instance LRU caches of chained block keys, with the
reverse map (key -> instances) that makes "who holds the longest prefix of this
request" cost one pass over the request's blocks, whatever the fleet size.

A **key** names a block *and everything before it* (a chained hash), so holding key
``i`` of a request means holding its first ``i + 1`` blocks' KV, provided the earlier
keys were not evicted first. Inserting a request's keys last-to-first makes its first
blocks the most recently used, so LRU eviction takes a prefix's tail before its head and
cached prefixes stay contiguous.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["PrefixIndex", "text_keys"]


def text_keys(text: str, chunk_chars: int = 1024, limit: int = 4096) -> list[int]:
    """Chained keys of ``text`` cut in ``chunk_chars`` pieces (whole pieces only: a
    partial last piece is not a cacheable block). The router uses them where it sees
    prompts but not tokens; ``limit`` bounds the work per request."""
    keys = []
    digest = b""
    data = text.encode("utf-8", "surrogatepass")
    for start in range(0, min(len(data), chunk_chars * limit) - chunk_chars + 1, chunk_chars):
        digest = hashlib.blake2b(digest + data[start:start + chunk_chars],
                                 digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little"))
    return keys


class PrefixIndex:
    """Cached blocks per instance (an int slot), each instance an LRU of ``capacity``
    blocks.

    :param capacity: blocks one instance caches (``0``: nothing is cached).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._holders: dict[Hashable, set[int]] = {}
        self._lru: dict[int, OrderedDict[Hashable, None]] = {}
        self.evictions = 0

    def overlaps(self, keys: Sequence[Hashable]) -> dict[int, int]:
        """For each instance holding at least the first block: how many leading blocks
        of ``keys`` it holds."""
        if not keys:
            return {}
        first = self._holders.get(keys[0])
        if not first:
            return {}
        depth: dict[int, int] = {}
        alive = set(first)
        for i in range(1, len(keys)):
            nxt = self._holders.get(keys[i])
            survivors = alive & nxt if nxt else set()
            if len(survivors) != len(alive):
                for node in alive - survivors:
                    depth[node] = i
            alive = survivors
            if not alive:
                break
        for node in alive:
            depth[node] = len(keys)
        return depth

    def longest(self, keys: Sequence[Hashable]) -> int:
        """Leading blocks of ``keys`` held by the best instance."""
        return max(self.overlaps(keys).values(), default=0)

    def insert(self, node: int, keys: Sequence[Hashable]) -> None:
        """``node`` now holds ``keys`` (a request's blocks); evicts its least recently
        used blocks beyond capacity."""
        if self.capacity == 0 or not keys:
            return
        lru = self._lru.get(node)
        if lru is None:
            lru = self._lru[node] = OrderedDict()
        holders = self._holders
        for key in reversed(keys[:self.capacity]):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                held = holders.get(key)
                if held is None:
                    holders[key] = {node}
                else:
                    held.add(node)
        while len(lru) > self.capacity:
            key, _ = lru.popitem(last=False)
            self._forget(node, key)
            self.evictions += 1

    def drop(self, node: int) -> None:
        """``node`` lost its cache (it left or restarted)."""
        for key in self._lru.pop(node, {}):
            self._forget(node, key)

    def blocks(self, node: int) -> int:
        return len(self._lru.get(node, ()))

    def _forget(self, node: int, key: Hashable) -> None:
        held = self._holders.get(key)
        if held is not None:
            held.discard(node)
            if not held:
                del self._holders[key]

    def __repr__(self) -> str:
        return (f"<PrefixIndex nodes={len(self._lru)} keys={len(self._holders)} "
                f"capacity={self.capacity}>")
