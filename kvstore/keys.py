"""Keys and checksums as the cluster store sends them.

Keys are 128-bit on the wire. An ``int`` key (e.g. a chained block hash from
:func:`kvstore.block_hashes`) is used as it is, and so are ``bytes`` of exactly 16 bytes
(the same key written little-endian, as :class:`kvstore.KVStore` with ``key_bytes=16``
takes it) and the rows of a ``uint64`` array of shape ``(n,)`` or ``(n, 2)`` (low word
first). Every other key is hashed (BLAKE2b-128): a ``str`` always, as its UTF-8 bytes
(so ``"ab"`` and ``b"ab"`` are one key), and other ``bytes``, so Mooncake-style string
keys work and distinct strings never share a 128-bit key: ``"abcdefgh"`` and
``"abcdefgh" + "\0" * 8`` are two keys, and neither is ``b"abcdefgh" + bytes(8)`` (the
int it spells). A hashed key meets a raw one only by a BLAKE2b collision, or when an
int is chosen to be one. (A ``str`` of 8 or 16 bytes, and 8 ``bytes``, were once taken
raw; every other key maps as it always did.)
A recorded checksum is a CRC32 with bit 32 set, so that 0 means "none recorded".
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.errors import KeyFormatError

__all__ = ["key_rows", "key_int", "crc"]

U64 = npt.NDArray[np.uint64]
_M64 = (1 << 64) - 1
_HAS_CRC = 1 << 32  # a recorded checksum: CRC32 with this bit set (0: none recorded)


def crc(data: Any) -> int:
    """The checksum the store records for ``data`` (bytes-like)."""
    return zlib.crc32(data) | _HAS_CRC


def _hashed(prefix: bytes, raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(prefix + raw, digest_size=16).digest(), "little")


def _key_int(key: object) -> int:
    if isinstance(key, bool):
        raise KeyFormatError("a key cannot be a bool")
    if isinstance(key, int | np.integer):
        k = int(key)
        if not 0 <= k < 1 << 128:
            raise KeyFormatError(f"key {k} does not fit in 128 unsigned bits")
        return k
    if isinstance(key, str):
        try:
            return _hashed(b"k", key.encode())
        except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
            raise KeyFormatError(f"a str key must be valid Unicode: {exc}") from exc
    if isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
        if len(raw) == 16:
            return int.from_bytes(raw, "little")
        return _hashed(b"k", raw)
    raise KeyFormatError(f"a key must be int, bytes or str, not {type(key).__name__}")


def key_int(row: U64) -> int:
    """A ``uint64[2]`` key row as the 128-bit integer it is (for messages)."""
    return int(row[0]) | int(row[1]) << 64


def key_rows(keys: object) -> U64:
    """``keys`` (a sequence of keys, or a ``uint64`` array) as ``uint64[n, 2]``."""
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.uint64 or keys.ndim not in (1, 2) or (
                keys.ndim == 2 and keys.shape[1] != 2):
            raise KeyFormatError("a key array must be uint64 of shape (n,) or (n, 2)")
        if keys.ndim == 1:
            out = np.zeros((keys.shape[0], 2), dtype=np.uint64)
            out[:, 0] = keys
            return out
        return np.ascontiguousarray(keys)
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Iterable):
        raise KeyFormatError("keys must be a sequence of keys or a uint64 array")
    ints = [_key_int(k) for k in keys]
    out = np.zeros((len(ints), 2), dtype=np.uint64)
    if ints:
        out[:, 0] = [k & _M64 for k in ints]
        out[:, 1] = [k >> 64 for k in ints]
    return out
