"""Every bad argument to every public KVStore method raises a StoreError and costs nothing:
the store holds what it held and still stores and returns random bytes afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore import KVStore, StoreClosedError, StoreError, ValueTooLargeError

SLAB = 1 << 16
Call = Callable[[KVStore], object]


def _released() -> memoryview:
    view = memoryview(b"released")
    view.release()
    return view


def _raises() -> float:
    raise RuntimeError("clock is broken")


BAD_KEYS: list[Any] = [
    "abc",
    "",
    None,
    1.5,
    float("nan"),
    True,
    False,
    -1,
    -(2**70),
    2**64,
    10**100,
    b"short",
    b"x" * 9,
    b"",
    bytearray(3),
    np.float64(1.0),
    np.int64(-5),
    np.bool_(True),
    np.array([1], dtype=np.uint64),
    np.array(1, dtype=np.uint64),
    [1],
    (1,),
    complex(1, 0),
    memoryview(b"12345678"),
    object(),
]

BAD_KEY_BATCHES: list[Any] = [
    "abcdefgh",
    b"12345678",
    bytearray(8),
    None,
    5,
    1.5,
    np.arange(3, dtype=np.int64),
    np.arange(3, dtype=np.float64),
    np.arange(3, dtype=np.uint32),
    np.zeros((3, 2), dtype=np.uint64),
    np.zeros((2, 2, 2), dtype=np.uint64),
    np.array(5, dtype=np.uint64),
    np.array(["a", "b"]),
    np.array([1, None], dtype=object),
    [1, "x"],
    [1, -1],
    [1, 2**64],
    [b"short"],
    [None],
    [1.0],
    {"a": 1},
]

BAD_VALUES: list[Any] = [
    "text",
    None,
    5,
    1.5,
    object(),
    [1, 2],
    np.arange(100, dtype=np.uint8)[::2],
    memoryview(bytearray(10))[::2],
    np.asfortranarray(np.ones((3, 4))),
    _released(),
    b"x" * SLAB,
    np.zeros(SLAB // 8, dtype=np.float64),
]

BAD_TTLS: list[Any] = [
    -1,
    0,
    0.0,
    -0.0,
    -1e-9,
    float("nan"),
    float("inf"),
    float("-inf"),
    np.float64("nan"),
    "5",
    b"5",
    True,
    False,
    np.bool_(True),
    10**400,
    [1],
    complex(1, 0),
    object(),
]


def _method_cases() -> list[tuple[str, Call]]:
    cases: list[tuple[str, Call]] = []
    for k in BAD_KEYS:
        r = repr(k)[:30]
        cases += [
            (f"put key {r}", lambda s, k=k: s.put(k, b"v")),
            (f"get key {r}", lambda s, k=k: s.get(k)),
            (f"delete key {r}", lambda s, k=k: s.delete(k)),
            (f"contains key {r}", lambda s, k=k: s.contains(k)),
            (f"in key {r}", lambda s, k=k: k in s),
        ]
    for ks in BAD_KEY_BATCHES:
        r = repr(ks)[:30]
        cases += [
            (f"batch_get keys {r}", lambda s, ks=ks: s.batch_get(ks)),
            (f"batch_delete keys {r}", lambda s, ks=ks: s.batch_delete(ks)),
            (f"batch_contains keys {r}", lambda s, ks=ks: s.batch_contains(ks)),
            (f"lookup keys {r}", lambda s, ks=ks: s.lookup(ks)),
            (f"batch_put keys {r}", lambda s, ks=ks: s.batch_put(ks, [b"a", b"b"])),
        ]
    for v in BAD_VALUES:
        r = repr(v)[:30]
        cases += [
            (f"put value {r}", lambda s, v=v: s.put(1, v)),
            (f"batch_put value {r}", lambda s, v=v: s.batch_put([1, 2], [b"ok", v])),
        ]
    for t in BAD_TTLS:
        r = repr(t)[:30]
        cases += [
            (f"put ttl {r}", lambda s, t=t: s.put(1, b"v", ttl=t)),
            (f"batch_put ttl {r}", lambda s, t=t: s.batch_put([1], [b"v"], ttl=t)),
        ]
    values_args: list[tuple[str, Any]] = [
        ("int", 5),
        ("None", None),
        ("bytes", b"ab"),
        ("str", "ab"),
        ("memoryview", memoryview(b"ab")),
        ("1-D array", np.zeros(2, dtype=np.uint8)),
        ("3 rows for 2 keys", np.ones((3, 4), dtype=np.uint8)),
        ("1 value for 2 keys", [b"a"]),
        ("3 values for 2 keys", [b"a", b"b", b"c"]),
        ("generator of 3", (b"x" for _ in range(3))),
        ("rows too wide", np.ones((2, SLAB), dtype=np.uint8)),
    ]
    for name, vals in values_args:
        cases.append((f"batch_put values {name}", lambda s, vals=vals: s.batch_put([1, 2], vals)))
    cases += [
        ("lookup touch str", lambda s: s.lookup([1], touch="yes")),  # type: ignore[arg-type]
        ("lookup touch None", lambda s: s.lookup([1], touch=None)),  # type: ignore[arg-type]
    ]
    return cases


WIDE_CASES: list[tuple[str, Call]] = [
    ("16-byte store: 8-byte key", lambda s: s.get(b"\x01" * 8)),
    ("16-byte store: 1-D keys", lambda s: s.batch_get(np.arange(3, dtype=np.uint64))),
    ("16-byte store: (n, 3) keys", lambda s: s.batch_get(np.zeros((3, 3), dtype=np.uint64))),
    ("16-byte store: 2**128", lambda s: s.put(2**128, b"v")),
]


def _store(key_bytes: int = 8) -> KVStore:
    return KVStore(8 * SLAB, slab_bytes=SLAB, key_bytes=key_bytes)


def _snapshot(store: KVStore, keys: list[int]) -> tuple[object, ...]:
    views = store.batch_get(keys)
    return (store.stats(), [None if v is None else bytes(v) for v in views])


def _round_trip(store: KVStore, rng: np.random.Generator) -> None:
    value = rng.integers(0, 256, size=int(rng.integers(1, 4000)), dtype=np.uint8).tobytes()
    key = int(rng.integers(10_000, 2**62))
    store.put(key, value)
    got = store.get(key)
    assert got is not None and bytes(got) == value
    store.verify()


CASES = [(8, n, c) for n, c in _method_cases()] + [(16, n, c) for n, c in WIDE_CASES]


@pytest.mark.parametrize(("key_bytes", "name", "call"), CASES, ids=[c[1] for c in CASES])
def test_bad_argument_raises_store_error_and_changes_nothing(
    key_bytes: int, name: str, call: Call
) -> None:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    with _store(key_bytes) as store:
        keys = list(range(1, 12))
        for k in keys:
            value = rng.integers(0, 256, size=500, dtype=np.uint8)
            store.put(k, value, ttl=100.0 if k % 2 else None)
        before = _snapshot(store, keys)
        with pytest.raises(StoreError) as info:
            call(store)
        assert str(info.value), f"{name}: an error without a message"
        assert _snapshot(store, keys) == before
        _round_trip(store, rng)


def test_the_table_covers_every_method_with_over_a_hundred_arguments() -> None:
    names = {n.split(" ")[0] for _, n, _ in CASES}
    assert {"put", "get", "delete", "contains", "in", "batch_get", "batch_put"} <= names
    assert {"batch_delete", "batch_contains", "lookup"} <= names
    assert len(CASES) > 300


def _ok_clock() -> float:
    return time.monotonic()


CONSTRUCTOR_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("capacity str", {"capacity_bytes": "1"}, "capacity_bytes"),
    ("capacity None", {"capacity_bytes": None}, "capacity_bytes"),
    ("capacity float", {"capacity_bytes": 8.0 * SLAB}, "capacity_bytes"),
    ("capacity bool", {"capacity_bytes": True}, "capacity_bytes"),
    ("capacity negative", {"capacity_bytes": -1}, "capacity_bytes"),
    ("capacity zero", {"capacity_bytes": 0}, "capacity_bytes"),
    ("capacity below a slab", {"capacity_bytes": 1000}, "capacity_bytes"),
    ("capacity 2**62", {"capacity_bytes": 2**62}, str(2**62)),
    ("capacity 2**70", {"capacity_bytes": 2**70}, str(2**70)),
    ("slab zero", {"slab_bytes": 0}, "slab_bytes"),
    ("slab negative", {"slab_bytes": -8}, "slab_bytes"),
    ("slab not a multiple of 8", {"slab_bytes": 1004}, "slab_bytes"),
    ("slab too small", {"slab_bytes": 16}, "slab_bytes"),
    ("slab str", {"slab_bytes": "x"}, "slab_bytes"),
    ("slab float", {"slab_bytes": 1024.0}, "slab_bytes"),
    ("slab bool", {"slab_bytes": True}, "slab_bytes"),
    ("slab above capacity", {"slab_bytes": 2**40}, "capacity_bytes"),
    ("key_bytes 4", {"key_bytes": 4}, "key_bytes"),
    ("key_bytes 32", {"key_bytes": 32}, "key_bytes"),
    ("key_bytes 8.0", {"key_bytes": 8.0}, "key_bytes"),
    ("key_bytes str", {"key_bytes": "8"}, "key_bytes"),
    ("key_bytes None", {"key_bytes": None}, "key_bytes"),
    ("key_bytes bool", {"key_bytes": True}, "key_bytes"),
    ("max_entries zero", {"max_entries": 0}, "max_entries"),
    ("max_entries negative", {"max_entries": -1}, "max_entries"),
    ("max_entries float", {"max_entries": 10.5}, "max_entries"),
    ("max_entries str", {"max_entries": "10"}, "max_entries"),
    ("max_entries bool", {"max_entries": True}, "max_entries"),
    ("max_entries beyond the arena", {"max_entries": 10**12}, "max_entries"),
    ("default_ttl negative", {"default_ttl": -1}, "ttl"),
    ("default_ttl zero", {"default_ttl": 0}, "ttl"),
    ("default_ttl nan", {"default_ttl": float("nan")}, "ttl"),
    ("default_ttl inf", {"default_ttl": float("inf")}, "ttl"),
    ("default_ttl str", {"default_ttl": "1"}, "ttl"),
    ("default_ttl bool", {"default_ttl": True}, "ttl"),
    ("granularity zero", {"ttl_granularity": 0}, "ttl_granularity"),
    ("granularity negative", {"ttl_granularity": -1.0}, "ttl_granularity"),
    ("granularity nan", {"ttl_granularity": float("nan")}, "ttl_granularity"),
    ("granularity inf", {"ttl_granularity": float("inf")}, "ttl_granularity"),
    ("granularity str", {"ttl_granularity": "1"}, "ttl_granularity"),
    ("granularity None", {"ttl_granularity": None}, "ttl_granularity"),
    ("granularity bool", {"ttl_granularity": True}, "ttl_granularity"),
    ("evict int", {"evict": 1}, "evict"),
    ("evict str", {"evict": "yes"}, "evict"),
    ("evict None", {"evict": None}, "evict"),
    ("threshold negative", {"compact_threshold": -0.1}, "compact_threshold"),
    ("threshold above 1", {"compact_threshold": 1.5}, "compact_threshold"),
    ("threshold nan", {"compact_threshold": float("nan")}, "compact_threshold"),
    ("threshold str", {"compact_threshold": "0.1"}, "compact_threshold"),
    ("threshold None", {"compact_threshold": None}, "compact_threshold"),
    ("threshold bool", {"compact_threshold": True}, "compact_threshold"),
    ("clock None", {"clock": None}, "clock"),
    ("clock int", {"clock": 5}, "clock"),
    ("clock returns str", {"clock": lambda: "t"}, "clock"),
    ("clock returns nan", {"clock": lambda: float("nan")}, "clock"),
    ("clock raises", {"clock": _raises}, "clock"),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "mentions"), CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES]
)
def test_bad_construction_raises_store_error_naming_the_argument(
    name: str, kwargs: dict[str, Any], mentions: str
) -> None:
    args: dict[str, Any] = {"capacity_bytes": 8 * SLAB, "slab_bytes": SLAB, "clock": _ok_clock}
    args.update(kwargs)
    with pytest.raises(StoreError) as info:
        KVStore(**args)
    assert mentions in str(info.value), f"{name}: {info.value}"


CLOSED_CALLS: list[tuple[str, Call]] = [
    ("put", lambda s: s.put(1, b"v")),
    ("get", lambda s: s.get(1)),
    ("delete", lambda s: s.delete(1)),
    ("contains", lambda s: s.contains(1)),
    ("in", lambda s: 1 in s),
    ("batch_put", lambda s: s.batch_put([1, 2], [b"a", b"b"])),
    ("batch_put empty", lambda s: s.batch_put([], [])),
    ("batch_get", lambda s: s.batch_get([1, 2])),
    ("batch_delete", lambda s: s.batch_delete([1])),
    ("batch_contains", lambda s: s.batch_contains([1])),
    ("lookup", lambda s: s.lookup([1])),
    ("expire", lambda s: s.expire()),
    ("compact", lambda s: s.compact()),
    ("stats", lambda s: s.stats()),
    ("verify", lambda s: s.verify()),
    ("slabs", lambda s: s.slabs()),
]


@pytest.mark.parametrize(("name", "call"), CLOSED_CALLS, ids=[c[0] for c in CLOSED_CALLS])
def test_use_after_close_raises_store_closed(name: str, call: Call) -> None:
    store = _store()
    store.put(1, b"v")
    store.close()
    with pytest.raises(StoreClosedError):
        call(store)
    assert len(store) == 0 and repr(store) == "<KVStore CLOSED>"
    store.close()


def test_odd_but_valid_arguments_are_accepted() -> None:
    """What the checks must not refuse: numpy scalars, exotic buffer formats, empty
    values, integer and numpy ttls, empty batches."""
    rng = np.random.default_rng(5)
    with _store() as store:
        store.put(np.uint64(7), b"", ttl=np.float64(5.0))
        assert bytes(store.get(7)) == b""  # type: ignore[arg-type]
        record = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
        record["a"] = rng.integers(0, 1000, size=3)
        store.put(8, record, ttl=np.int64(5))
        assert bytes(store.get(8)) == record.tobytes()  # type: ignore[arg-type]
        words = np.array(["ab", "cd"])
        store.batch_put([9, 10], [words, memoryview(words)], ttl=3)
        assert bytes(store.get(10)) == words.tobytes()  # type: ignore[arg-type]
        store.batch_put([], [])
        assert store.batch_get([]) == [] and store.batch_delete([]).size == 0
        with pytest.raises(ValueTooLargeError):
            store.put(11, np.zeros(SLAB, dtype=np.uint8))
        store.verify()
