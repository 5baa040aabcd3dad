"""The kvstore client against a master that answers wrongly: a fake master on loopback
(a real control :class:`Service`, replies built by hand) sends malformed or lying
``kv-located`` answers. Each must be refused with a :class:`ProtocolError` naming the
master, before the client allocates what the answer claims, and the client must stay
usable. Then, with a real master and node: large gets go through staging in pieces and
the staging buffer does not stay grown."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvstore.client import Client
from kvstore.errors import InvalidArgumentError, ObjectUnavailableError
from kvstore.master import Master
from kvstore.node import StorageNode
from kvstore.protocol import KvFound, KvGet, KvLocated, KvStatsReply, pack
from kvstore.transfers import staging_pieces
from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.messages import Message
from transfer_engine.control.service import Service
from transfer_engine.errors import ProtocolError

NODE = ["node0", "inc", "tcp://127.0.0.1:9", "node0/dram"]
Reply = Callable[[int], Message]


def located(lengths: list[int], pools: list[int], offsets: list[int], *,
            nodes: list[Any] | None = None, status: list[int] | None = None,
            replicas: int = 1, lease_id: int = 1, lease_s: float = 5.0) -> Reply:
    """A ``kv-located`` answer for a batch of ``len(lengths)`` keys, as given."""
    n = len(lengths)
    return lambda _n: KvLocated(
        lease_id=lease_id, lease_s=lease_s, status=pack(status or [0] * n, "<i1"),
        lengths=pack(lengths, "<i8"), checksums=pack([0] * n, "<u8"),
        versions=pack([1] * n, "<u8"), replicas=replicas,
        nodes=[NODE] if nodes is None else nodes, pools=pack(pools, "<i4"),
        offsets=pack(offsets, "<i8"))


def missing(n: int) -> Message:
    """The honest answer for keys that are not stored."""
    return KvLocated(lease_id=0, lease_s=5.0, status=pack([1] * n, "<i1"),
                     lengths=pack([0] * n, "<i8"), checksums=pack([0] * n, "<u8"),
                     versions=pack([0] * n, "<u8"), replicas=1, nodes=[],
                     pools=pack([-1] * n, "<i4"), offsets=pack([0] * n, "<i8"))


class FakeMaster:
    """Answers ``kv-get`` with whatever ``reply`` builds (per batch size), other
    requests with empty stats."""

    def __init__(self) -> None:
        self.reply: Reply = missing
        self.zctx = zmq.Context()
        self.svc = Service(self.zctx, "127.0.0.1", 0, self._handle, "fake-master", None)
        self.endpoint = self.svc.endpoint

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, KvGet):
            return self.reply(len(msg.keys) // 16)
        return KvStatsReply(stats={})

    def close(self) -> None:
        self.svc.close()
        self.zctx.term()


@pytest.fixture
def fake() -> Iterator[tuple[FakeMaster, Client]]:
    master = FakeMaster()
    try:
        client = Client(master.endpoint, timeout=3.0, auth=AuthConfig(),
                        max_value_bytes=1 << 20)
        try:
            yield master, client
        finally:
            client.close()
    finally:
        master.close()


HOSTILE: list[tuple[str, Reply, str]] = [
    ("pool index past the node rows", located([100], [5], [0]), "names pool 5"),
    ("pool index below -1", located([100], [-2], [0]), "names pool -2"),
    ("a replica after a -1", located([100], [-1, 0], [0, 0], replicas=2), "replica 1"),
    ("negative offset", located([100], [0], [-8]), "at offset -8"),
    ("node row of 2 fields", located([100], [0], [0], nodes=[["node0", "inc"]]),
     "node row 0"),
    ("node row is an int", located([100], [0], [0], nodes=[7]), "node row 0 is 7"),
    ("node row with an int field", located([100], [0], [0], nodes=[[1, 2, 3, 4]]),
     "node row 0"),
    ("zero replicas", located([100], [], [], replicas=0), "replicas 0"),
    ("lease id below 0", located([100], [0], [0], lease_id=-1), "lease id -1"),
    ("negative lease", located([100], [0], [0], lease_s=-1.0), "lease of -1.0"),
    ("negative length", located([-5], [0], [0]), "-5 bytes for key"),
    ("another kind of answer", lambda _n: KvFound(status=pack([0], "<i1")),
     "expected a kv-located answer"),
]


@pytest.mark.parametrize("reply,needle", [(r, s) for _, r, s in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])
def test_a_malformed_answer_is_refused_and_the_client_stays_usable(
        fake: tuple[FakeMaster, Client], reply: Reply, needle: str) -> None:
    master, client = fake
    master.reply = reply
    with pytest.raises(ProtocolError) as caught:
        client.get(b"some-key-16bytes")
    assert needle in str(caught.value)
    assert caught.value.peer == master.endpoint
    assert client._staging is None  # nothing staged on the answer's word
    master.reply = missing
    assert client.get(b"some-key-16bytes") is None


@pytest.mark.parametrize("length", [3 << 30, 1 << 40])
def test_a_value_too_large_to_stage_is_refused(fake: tuple[FakeMaster, Client],
                                               length: int) -> None:
    """True or not, a length over ``max_value_bytes`` is never staged; it is the
    caller's to read with ``get_into``, not the master's fault."""
    master, client = fake
    master.reply = located([length], [0], [0])
    with pytest.raises(InvalidArgumentError, match=f"{length} bytes .*max_value_bytes"):
        client.get(b"some-key-16bytes")
    assert client._staging is None
    master.reply = missing
    assert client.get(b"some-key-16bytes") is None


def test_get_into_refuses_a_negative_length(fake: tuple[FakeMaster, Client]) -> None:
    master, client = fake
    buf = np.zeros(4096, dtype=np.uint8)
    seg = client.register_buffer(buf)
    try:
        master.reply = located([-1], [0], [0])
        with pytest.raises(ProtocolError, match="never negative"):
            client.get_into([7], [buf])
        master.reply = missing
        assert client.get_into([7], [buf]) == [None]
    finally:
        seg.close()


def test_lengths_of_missing_keys_are_not_staged(fake: tuple[FakeMaster, Client]) -> None:
    """The lengths of keys the master says are missing are not what the client reads."""
    master, client = fake
    master.reply = located([1 << 40, 1 << 40], [-1, -1], [0, 0], status=[1, 1])
    assert client.batch_get([1, 2]) == [None, None]
    assert client._staging is None


def test_staging_pieces_split_by_size() -> None:
    padded = np.array([64, 128, 64, 4096, 64, 0, 192, 8192], dtype=np.int64)
    found = np.array([True, True, False, True, True, True, True, True])
    pieces = staging_pieces(padded, found, 256)
    assert [p.tolist() for p in pieces] == [[0, 1, 4, 5], [6], [7], [3]]
    assert [p.tolist() for p in staging_pieces(padded, found, 1 << 20)] == [
        [0, 1, 3, 4, 5, 6, 7]]
    assert staging_pieces(padded, np.zeros(8, dtype=bool), 256) == []
    only_big = staging_pieces(padded, padded > 256, 256)
    assert [p.tolist() for p in only_big] == [[7], [3]]


@pytest.fixture
def cluster() -> Iterator[Master]:
    with Master() as m:
        node = StorageNode(m.endpoint, 16 << 20, name="n0")
        try:
            m.wait_nodes(1)
            yield m
        finally:
            node.close()


def test_large_gets_go_through_staging_in_pieces(cluster: Master) -> None:
    """A batch larger than the staging kept between calls is read in pieces of that
    size, a value larger than it in a buffer of its own, and neither stays."""
    rng = np.random.default_rng(5)
    with Client(cluster.endpoint, staging_bytes=1 << 16, auth=AuthConfig()) as client:
        client._staging_keep = 1 << 16  # what 64 MiB is to a default client
        values = [rng.bytes(n) for n in (40_000, 30_000, 200_000, 10, 0, 50_000)]
        keys = list(range(100, 106))
        client.batch_put(keys, values)
        assert client._staging is not None and client._staging.nbytes > 1 << 16
        assert client.batch_get(keys + [999], verify=True) == values + [None]
        assert client._staging is None  # the 200 kB value came last, in its own buffer
        assert client.get(102) == values[2]
        assert client._staging is None
        small = [k for k, v in zip(keys, values, strict=True) if len(v) < 1 << 16]
        assert client.batch_get(small) == [v for v in values if len(v) < 1 << 16]
        assert client._staging is not None and client._staging.nbytes == 1 << 16  # kept
        assert client.batch_get(keys) == values


def test_max_value_bytes_bounds_staged_gets_only(cluster: Master) -> None:
    with Client(cluster.endpoint, max_value_bytes=1000, auth=AuthConfig()) as client:
        client.put(1, b"v" * 4096)
        with pytest.raises(InvalidArgumentError, match=f"key {1:#x}: over this client's "
                                                "max_value_bytes=1000"):
            client.get(1)
        buf = np.zeros(4096, dtype=np.uint8)
        seg = client.register_buffer(buf)
        try:
            assert client.get_into([1], [buf]) == [4096] and bytes(buf) == b"v" * 4096
        finally:
            seg.close()
        client.put(2, b"small")
        assert client.get(2) == b"small"
    with pytest.raises(ValueError, match="max_value_bytes"):
        Client(cluster.endpoint, max_value_bytes=0)


def test_pieces_with_a_local_tier(cluster: Master) -> None:
    """Values served by the local tier and values read from the node, over pieces."""
    rng = np.random.default_rng(6)
    values = [rng.bytes(n) for n in (30_000, 30_000, 100_000, 30_000)]
    with Client(cluster.endpoint, auth=AuthConfig()) as writer:
        writer.batch_put([1, 2, 3, 4], values)
    with Client(cluster.endpoint, staging_bytes=1 << 16, local_cache_bytes=1 << 20,
                local_max_value_bytes=40_000, auth=AuthConfig()) as client:
        client._staging_keep = 1 << 16
        assert client.batch_get([1, 2, 3, 4], verify=True) == values
        assert client.batch_get([4, 3, 2, 1, 9]) == values[::-1] + [None]
        assert client.stats()["local_hits"] == 3  # the 100 kB value is not kept locally


def test_a_failed_large_get_gives_its_buffer_back_at_once(
        fake: tuple[FakeMaster, Client], monkeypatch: pytest.MonkeyPatch) -> None:
    """A value larger than the staging kept gets a buffer of its own; when its read
    fails (the node named does not answer) the buffer is freed on return, not when the
    collector breaks the failure's reference cycles."""
    master, client = fake
    client._staging_keep = 1 << 16
    buffers: list[weakref.ref[Any]] = []
    register = client.register_buffer

    def spy(obj: Any) -> Any:
        buffers.append(weakref.ref(obj))
        return register(obj)

    monkeypatch.setattr(client, "register_buffer", spy)
    master.reply = located([1 << 20], [0], [0])
    gc.disable()
    try:
        with pytest.raises(ObjectUnavailableError):
            client.get(b"some-key-16bytes")
        assert len(buffers) == 1 and buffers[0]() is None
    finally:
        gc.enable()
    assert client._staging is None
