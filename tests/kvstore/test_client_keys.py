"""How the cluster store's client maps user keys to 128-bit keys: ints, 16-byte bytes
and ``uint64`` rows are the key itself; strings (as their UTF-8 bytes) and other bytes
are hashed, as they always were, so distinct keys never share a 128-bit key (a ``str``
of 8 or 16 characters once went raw, so ``"abcdefgh"`` and ``"abcdefgh" + "\\0" * 8`` were
one key)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.errors import KeyFormatError
from kvstore.keys import key_int, key_rows
from kvstore.master import Master
from kvstore.mooncake_store import ErrorCode, MooncakeDistributedStore


def k(key: object) -> int:
    return key_int(key_rows([key])[0])


def test_distinct_keys_never_share_a_128_bit_key() -> None:
    word = int.from_bytes(b"abcdefgh", "little")
    keys: list[object] = ["abcdefgh", "abcdefgh" + "\0" * 8, "abcdefghabcdefgh",
                          b"abcdefghabcdefgh", word, "", "x", bytearray(b"y"),
                          "\udcff".encode("utf-8", "surrogatepass"), "é"]
    mapped = [k(key) for key in keys]
    assert len(set(mapped)) == len(keys)


def test_ints_16_byte_bytes_and_uint64_rows_are_the_key_itself() -> None:
    word = int.from_bytes(b"abcdefgh", "little")
    assert k(word) == word
    assert k(b"abcdefgh" + bytes(8)) == word  # the same 128-bit key, written little-endian
    assert k(np.uint64(5)) == 5 and k(1 << 127) == 1 << 127
    assert key_int(key_rows(np.array([word], dtype=np.uint64))[0]) == word
    assert key_int(key_rows(np.array([[1, 2]], dtype=np.uint64))[0]) == 1 | 2 << 64


def test_strings_and_other_bytes_are_hashed_as_they_always_were() -> None:
    def blake(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")

    # stored string keys stay reachable across an upgrade: the same 128-bit key
    assert k("layer0/block7") == blake(b"k" + b"layer0/block7") == k(b"layer0/block7")
    assert k("é") == k("é".encode()) and k("") == k(b"") == blake(b"k")
    assert k(b"abcdefgh") == blake(b"kabcdefgh")  # 8 bytes: hashed now, not raw
    assert k("abcdefghabcdefgh") == blake(b"kabcdefghabcdefgh")  # 16 characters too


@pytest.mark.parametrize("bad", [True, -1, 1 << 128, 1.5, None, "\udcff", object()])
def test_keys_that_are_refused(bad: object) -> None:
    with pytest.raises(KeyFormatError):
        key_rows([bad])


def test_mooncake_string_keys_of_8_and_16_characters_do_not_collide() -> None:
    with Master() as master:
        store = MooncakeDistributedStore()
        try:
            assert store.setup("127.0.0.1", "", 16 << 20, 4 << 20, "tcp", "",
                               master.endpoint) == 0
            master.wait_nodes(1)
            assert store.put("abcdefgh", b"first") == 0
            assert store.get("abcdefgh" + "\0" * 8) == b""
            assert store.put("abcdefgh" + "\0" * 8, b"second") == 0
            assert store.get("abcdefgh") == b"first"
            assert store.get("abcdefgh" + "\0" * 8) == b"second"
            assert store.put("\udcff", b"v") == ErrorCode.INVALID_PARAMS
            assert store.get("\udcff") == b""
        finally:
            store.close()
