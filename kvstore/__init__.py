"""In-memory KV block store: a partial-key cuckoo index over a slab arena, with
time-layered expiry and CLOCK reclamation.

``KVStore`` is the facade; ``block_hashes`` turns token ids into the chained keys it
expects. ``CuckooIndex``, ``Arena``, ``ExpiryLayers`` and ``ClockReclaimer`` are exported
for the engine (slab registration) and for tests.
"""

from kvstore.arena import Arena
from kvstore.errors import (
    CapacityError,
    InvalidArgumentError,
    KeyFormatError,
    StoreClosedError,
    StoreError,
    ValueTooLargeError,
)
from kvstore.hashing import block_hashes
from kvstore.index import CuckooIndex
from kvstore.store import KVStore, StoreStats
from kvstore.ttl import ClockReclaimer, ExpiryLayers

__all__ = [
    "KVStore",
    "StoreStats",
    "block_hashes",
    "CuckooIndex",
    "Arena",
    "ExpiryLayers",
    "ClockReclaimer",
    "StoreError",
    "InvalidArgumentError",
    "KeyFormatError",
    "ValueTooLargeError",
    "CapacityError",
    "StoreClosedError",
]
