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


class MasterUnavailableError(StoreError):
    """The store's master did not answer in time (down, restarting or unreachable).

    Nothing is known about the request's effect: a put's space may have been allocated
    (it is reclaimed when the put's deadline passes), a get holds no lease."""


class PutError(StoreError):
    """Some values of a put could not be stored: no replica could be written, or the
    master refused the commit (it restarted, or the put's deadline passed).

    ``keys`` lists them. Those keys keep whatever they held before the put (a reader
    never sees a half-written value); the other keys of the batch are stored."""

    def __init__(self, message: str, keys: list[object] | None = None) -> None:
        super().__init__(message)
        self.keys = keys or []


class ObjectUnavailableError(StoreError):
    """A key is stored but none of its replicas could be read (their nodes were lost,
    or every copy failed its checksum). ``key`` names it, ``reasons`` says what each
    replica did.

    A ``get_into`` destination may hold any bytes of a failed read; ``get`` returns
    nothing. No wrong bytes are ever returned as a value."""

    def __init__(self, message: str, key: object = None, reasons: list[str] | None = None
                 ) -> None:
        super().__init__(message)
        self.key = key
        self.reasons = reasons or []
