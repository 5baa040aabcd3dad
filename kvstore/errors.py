"""Errors raised by the KV store.

Every error is a :class:`StoreError`, itself a
:class:`transfer_engine.errors.TransferEngineError`, so one ``except`` catches the whole
project. Each docstring states what the failed call leaves behind.
"""

from __future__ import annotations

from transfer_engine.errors import TransferEngineError

__all__ = [
    "StoreError",
    "InvalidArgumentError",
    "KeyFormatError",
    "ValueTooLargeError",
    "CapacityError",
    "StoreClosedError",
]


class StoreError(TransferEngineError):
    """Root of every error the KV store raises."""


class InvalidArgumentError(StoreError, ValueError):
    """An argument was rejected before anything was touched (e.g. a negative or non-finite
    TTL, a non-bytes value, duplicate keys where unique ones are required).

    The store is unchanged.
    """


class KeyFormatError(InvalidArgumentError):
    """A key has the wrong type or width (not a 64/128-bit integer, ``bytes`` of the
    configured length, or a ``uint64`` array of the right shape).

    The store is unchanged.
    """


class ValueTooLargeError(InvalidArgumentError):
    """A value (plus its record header) does not fit in one slab, so it can never be
    stored whatever is evicted.

    The store is unchanged.
    """


class CapacityError(StoreError):
    """There is no room: the arena has no space for the record, or the index found no
    free slot for the key (displacement search and stash exhausted).

    Nothing that was stored before the call is lost and the failed entry is not stored
    (a batch is rolled back as a whole). When the store is allowed to evict, entries
    evicted while trying to make room stay evicted.
    """


class StoreClosedError(StoreError):
    """The store was closed; its memory is released. Nothing was done."""
