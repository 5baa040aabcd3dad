"""Chained block hashes: the keys of a token sequence's KV blocks.

Block ``i`` is keyed by ``H(key[i-1] || tokens[i*bs:(i+1)*bs])`` (BLAKE2b, tokens as
little-endian int64), so a key names the block *and its whole prefix*: two requests that
share their first ``k`` blocks share their first ``k`` keys, and no later block can match
unless everything before it does. A trailing partial block gets no key (its KV is not
complete). ``parent`` continues a chain, e.g. from the last key of a cached prefix.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgumentError, KeyFormatError

__all__ = ["block_hashes"]


def block_hashes(
    token_ids: npt.ArrayLike,
    block_size: int,
    *,
    key_bytes: int = 8,
    parent: int | None = None,
    salt: bytes = b"",
) -> npt.NDArray[np.uint64]:
    """Keys of the full blocks of ``token_ids``.

    Parameters:
        token_ids: 1-D integer token ids.
        block_size: tokens per block (> 0).
        key_bytes: 8 (returns ``uint64[n]``) or 16 (returns ``uint64[n, 2]``, low word
            first), matching :class:`kvstore.KVStore`'s ``key_bytes``.
        parent: key of the block before ``token_ids[0]`` when continuing a chain.
        salt: mixed into the first block, e.g. a model or LoRA id, so different models
            never share keys.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, not {block_size!r}")
    if key_bytes not in (8, 16):
        raise KeyFormatError(f"key_bytes must be 8 or 16, not {key_bytes!r}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise InvalidArgumentError("token_ids must be a 1-D sequence of integers")
    data = tokens.astype("<i8", copy=False).tobytes()
    words = key_bytes // 8
    n = tokens.size // block_size
    out = np.empty((n, words), dtype=np.uint64)
    if parent is None:
        prev = salt
    else:
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise KeyFormatError(f"parent must be an int key, not {type(parent).__name__}")
        if not 0 <= parent < 1 << (8 * key_bytes):
            raise KeyFormatError(f"parent does not fit in {key_bytes} bytes")
        prev = parent.to_bytes(key_bytes, "little") + salt
    step = 8 * block_size
    for i in range(n):
        digest = hashlib.blake2b(
            prev + data[i * step : (i + 1) * step], digest_size=key_bytes
        ).digest()
        out[i] = np.frombuffer(digest, dtype="<u8")
        prev = digest + salt
    return out[:, 0].copy() if words == 1 else out
