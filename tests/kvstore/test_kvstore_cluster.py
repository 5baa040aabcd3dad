"""The cluster store end to end: a real master, real nodes (threads and processes), real
engines moving random bytes, checked byte for byte."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from bench.fleet import free_port
from kvstore import block_hashes
from kvstore.client import Client, key_rows
from kvstore.errors import (
    InvalidArgumentError,
    MasterUnavailableError,
    ObjectUnavailableError,
    PutError,
    StoreError,
)
from kvstore.master import Master
from kvstore.node import StorageNode
from kvstore.protocol import KvGet
from tests.helpers.cluster_helpers import NodeProcess
from tests.helpers.faults import raw_link, release_lease
from transfer_engine.errors import AuthenticationError

SECRET = "kvstore-test-secret-0123456789"


def _values(rng: np.random.Generator, n: int, top: int = 20000) -> list[bytes]:
    return [rng.integers(0, 256, int(rng.integers(1, top)), dtype=np.uint8).tobytes()
            for _ in range(n)]


@pytest.fixture
def cluster() -> Iterator[tuple[Master, list[StorageNode]]]:
    with Master(lease_s=2.0, put_timeout_s=3.0, node_interval=0.1) as master:
        nodes = [StorageNode(master.endpoint, 8 << 20, name=f"n{i}", zone=f"z{i}")
                 for i in range(3)]
        try:
            master.wait_nodes(3)
            yield master, nodes
        finally:
            for node in nodes:
                node.close()


def test_put_get_replicas_exists_prefix_remove(cluster: tuple[Master, list[StorageNode]]
                                               ) -> None:
    master, nodes = cluster
    rng = np.random.default_rng(1)
    keys = [int(k) for k in rng.integers(0, 2**63, 40)]
    vals = _values(rng, 40)
    with Client(master.endpoint, replicas=2, checksum=True) as client:
        client.batch_put(keys, vals)
        assert client.batch_get(keys, verify=True) == vals
        assert client.get("absent") is None and not client.exists(12345)
        client.put("a string key", b"mooncake style")
        assert client.get("a string key") == b"mooncake style"
        stats = client.stats()
        assert stats["objects"] == 41
        # every object sits on two distinct nodes: the directories hold 2 x 41 entries
        time.sleep(0.3)
        assert sum(len(n.directory) for n in nodes) == 82
        # a chain of block hashes: the stored prefix is found in one request
        chain = block_hashes(np.arange(16 * 10), 16)
        client.batch_put(chain[:6], [b"x" * 10] * 6)
        assert client.longest_prefix(chain) == 6
        assert client.longest_prefix(chain[6:]) == 0
        assert client.batch_remove(keys[:10]).all() and not client.remove(keys[0])
        assert client.batch_get(keys[:12]) == [None] * 10 + vals[10:12]
        with pytest.raises(InvalidArgumentError):
            client.batch_put([1, 1], [b"a", b"b"])
        for bad in (None, "text", 7, memoryview(b"abcdef")[::2]):  # not contiguous bytes
            with pytest.raises(InvalidArgumentError, match="value 1"):
                client.batch_put([500, 501], [b"ok", bad])
        assert client.batch_get([500, 501]) == [None, None]


def test_zero_copy_and_overwrite(cluster: tuple[Master, list[StorageNode]]) -> None:
    master, _ = cluster
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(2 << 20, dtype=np.uint8)
    with Client(master.endpoint) as client:
        with client.register_buffer(src), client.register_buffer(dst):
            client.put_from([10, 11, 12], [src[:4096], src[4096:70000], src[70000:]])
            got = client.get_into([12, 10, 99], [dst[:1 << 20], dst[1 << 20:(1 << 20) + 4096],
                                                 dst[-10:]])
            assert got == [(1 << 20) - 70000, 4096, None]
            assert np.array_equal(dst[:(1 << 20) - 70000], src[70000:])
            assert np.array_equal(dst[1 << 20:(1 << 20) + 4096], src[:4096])
            with pytest.raises(InvalidArgumentError):
                client.get_into([11], [dst[:100]])  # too small for the value
            with pytest.raises(InvalidArgumentError):
                client.put_from([13], [np.zeros(10, dtype=np.uint8)])  # not registered
        client.put(10, b"new")
        assert client.get(10) == b"new"
        client.put(10, b"newer", if_absent=True)
        assert client.get(10) == b"new"


def test_eviction_keeps_puts_going(cluster: tuple[Master, list[StorageNode]]) -> None:
    master, nodes = cluster
    rng = np.random.default_rng(3)
    with Client(master.endpoint) as client:
        written: dict[int, bytes] = {}
        for batch in range(12):  # 12 x 16 x 256 KiB = 48 MiB through 24 MiB of pools
            vals = [rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()
                    for _ in range(16)]
            keys = list(range(batch * 16, batch * 16 + 16))
            client.batch_put(keys, vals)
            written.update(zip(keys, vals, strict=True))
        got = client.batch_get(list(written))
        assert sum(v is not None for v in got) > 16
        for k, v in zip(written, got, strict=True):
            assert v is None or v == written[k]
        assert client.batch_get(list(range(176, 192))) == [written[k] for k in range(176, 192)]
        assert master.stats()["evictions"] > 0
        # the nodes' directories agree with the master once the journal settled
        time.sleep(0.3)
        assert sum(len(n.directory) for n in nodes) == master.stats()["objects"]


def test_lease_holds_space_until_released(cluster: tuple[Master, list[StorageNode]]) -> None:
    master, _ = cluster
    with master._lock:  # the churn below may take the fixture's 2 s on a loaded host
        master.lease_s = 60.0
    with Client(master.endpoint) as client:
        client.put(1, os.urandom(1 << 20))
        with raw_link(client) as request:  # take a lease the way a get does, and keep it
            reply = request(KvGet(keys=key_rows([1]).tobytes()), 5.0)
        where = master.table
        row = int(where.lookup(key_rows([1]))[0])
        leased = (int(where.pool[row, 0]), int(where.offset[row, 0]))
        client.remove(1)
        rng = np.random.default_rng(4)
        for i in range(30):  # churn far more than the pools hold
            client.batch_put(range(100 + 8 * i, 108 + 8 * i),
                             [rng.bytes(256 << 10) for _ in range(8)])
        t = master.table
        live = t.state[: t.capacity] != 0
        used = set(zip(t.pool[: t.capacity][live, 0].tolist(),
                       t.offset[: t.capacity][live, 0].tolist(), strict=True))
        assert leased not in used or int(t.leases[row]) > 0
        assert master.stats()["leases"] >= 1
        release_lease(client, reply.lease_id)
        client.exists(0)
        assert master.stats()["leases"] == 0


def _race_overwrites(master: Master, seed: int,
                     reader_for: Callable[[Client], Callable[[], list[bytes | None]]], *,
                     puts: int, replicas: int = 1, remove_every: int = 0,
                     pause_every: int = 0) -> int:
    """Two readers read keys k0 and k1 (each through ``reader_for(its client)``) while a
    writer overwrites them ``puts`` times (and removes k1 every ``remove_every`` puts);
    asserts every value read is one that was written. Returns the readers'
    ``guessed_reads``."""
    rng = np.random.default_rng(seed)
    versions = [rng.bytes(int(rng.integers(1000, 200_000))) for _ in range(30)]
    allowed = set(versions)
    errors: list[str] = []
    guessed: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        with Client(master.endpoint) as c:
            read = reader_for(c)
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                for v in read():
                    if v is not None and v not in allowed:
                        errors.append(f"read {len(v)} bytes never written")
            guessed.append(c.guessed_reads)

    with Client(master.endpoint, replicas=replicas) as writer:
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(puts):
                writer.batch_put(["k0", "k1"], [versions[i % 30], versions[(i * 7) % 30]])
                if remove_every and i % remove_every == remove_every - 1:
                    writer.remove("k1")
                if pause_every and i % pause_every == 0:
                    time.sleep(0.002)  # let the readers find their guesses still right
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not errors, errors[:3]
    return sum(guessed)


def test_readers_race_overwrites_byte_exact(cluster: tuple[Master, list[StorageNode]]) -> None:
    master, _ = cluster
    _race_overwrites(master, 5, lambda c: lambda: c.batch_get(["k0", "k1"]), puts=120,
                     replicas=2)


def test_get_into_reads_a_remembered_place_only_when_the_master_confirms_it(
        cluster: tuple[Master, list[StorageNode]]) -> None:
    """get_into starts reading where a key was last seen while the master answers; a key
    overwritten (new version, new place), removed, or whose space went to another key
    is read again or reported missing, never returned with other bytes."""
    master, _ = cluster
    rng = np.random.default_rng(17)
    with Client(master.endpoint) as client:
        dst = np.zeros(4 << 20, dtype=np.uint8)
        client.register_buffer(dst)
        cap = 1 << 20

        def read(keys: list[str]) -> list[bytes | None]:
            views = [dst[i * cap:(i + 1) * cap] for i in range(len(keys))]
            got = client.get_into(keys, views)
            return [None if n is None else views[i][:n].tobytes()
                    for i, n in enumerate(got)]

        a, b = rng.bytes(300_000), rng.bytes(200_000)
        client.batch_put(["a", "b"], [a, b])
        assert read(["a", "b"]) == [a, b]
        before = client.guessed_reads
        assert read(["a", "b"]) == [a, b]
        assert client.guessed_reads == before + 2, "a second read starts at the place seen"
        a2 = rng.bytes(300_000)  # same length: only the version tells them apart
        filler = [rng.bytes(300_000) for _ in range(40)]  # takes the freed space again
        with Client(master.endpoint) as other:  # changes our client does not see
            other.put("a", a2)  # a new version in a new place
            other.remove("b")
            for i in range(0, 40, 8):
                other.batch_put([f"f{j}" for j in range(i, i + 8)], filler[i:i + 8])
        dst.fill(0)
        assert read(["a", "b", "f3"]) == [a2, None, filler[3]]
        assert read(["a", "f3"]) == [a2, filler[3]]
        loose = np.zeros(cap, dtype=np.uint8)  # not registered: refused, nothing left over
        with pytest.raises(InvalidArgumentError):
            client.get_into(["a"], [loose])
        assert not loose.any()
        assert read(["a", "f3"]) == [a2, filler[3]]


def test_get_into_races_overwrites_and_removes_byte_exact(
        cluster: tuple[Master, list[StorageNode]]) -> None:
    master, _ = cluster

    def reader_for(c: Client) -> Callable[[], list[bytes | None]]:
        dst = np.zeros(2 * 200_000, dtype=np.uint8)
        c.register_buffer(dst)
        views = [dst[:200_000], dst[200_000:]]

        def read() -> list[bytes | None]:
            return [None if n is None else view[:n].tobytes()
                    for view, n in zip(views, c.get_into(["k0", "k1"], views), strict=True)]
        return read

    assert _race_overwrites(master, 18, reader_for, puts=150, remove_every=10,
                            pause_every=4) > 0


def test_node_killed_mid_get_reads_other_replica_or_fails_precisely() -> None:
    rng = np.random.default_rng(6)
    with Master(lease_s=5.0, node_interval=0.1, node_max_missed=30) as master:
        with NodeProcess(master.endpoint, "p0", 96 << 20) as p0, \
                NodeProcess(master.endpoint, "p1", 96 << 20) as p1:
            master.wait_nodes(2)
            with Client(master.endpoint, timeout=5.0) as client:
                twice = [rng.bytes(1 << 20) for _ in range(40)]
                client.batch_put(range(40), twice, replicas=2)
                once = [rng.bytes(1 << 20) for _ in range(8)]
                client.batch_put(range(100, 108), once, replicas=1)
                placed = master.table
                on_p0 = [k for k in range(100, 108) if placed.pool[int(placed.lookup(
                    key_rows([k]))[0]), 0] == 0]
                results: list[object] = []

                def read() -> None:
                    try:
                        for _ in range(5):
                            results.append(client.batch_get(range(40)))
                    except StoreError as exc:
                        results.append(exc)

                t = threading.Thread(target=read)
                t.start()
                time.sleep(0.05)
                p0.kill()
                t.join(60)
                for r in results:
                    assert isinstance(r, list) and r == twice, "replicated values must survive"
                assert client.batch_get(range(40)) == twice
                if on_p0:
                    # the node is known dead (a precise error) or already dropped by
                    # the master (a miss), depending on timing; never other bytes
                    try:
                        lost = client.get(on_p0[0])
                    except ObjectUnavailableError:
                        lost = None
                    assert lost is None
                # once the master drops the node, the lost keys are plain misses
                deadline = time.monotonic() + 10
                while "p0" in master.stats()["nodes"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                got = client.batch_get(range(100, 108))
                for k, v in zip(range(100, 108), got, strict=True):
                    assert (v is None) if k in on_p0 else v == once[k - 100]
                # a put with two replicas now lands on the one node left
                client.put(500, b"after", replicas=2)
                assert client.get(500) == b"after"
            assert p1.proc.poll() is None


def test_node_paused_past_its_drop_during_a_put_is_written_again_elsewhere() -> None:
    """A node stalls (SIGSTOP) while a put writes to it; the master drops it for silence
    before the write completes. The put places those keys again on the node still up
    and succeeds; every value reads back byte for byte; the node rejoins on SIGCONT."""
    rng = np.random.default_rng(16)
    with Master(lease_s=5.0, node_interval=0.1, node_max_missed=4) as master:
        with NodeProcess(master.endpoint, "s0", 32 << 20) as s0, \
                NodeProcess(master.endpoint, "s1", 32 << 20):
            master.wait_nodes(2)
            with Client(master.endpoint, timeout=10.0) as client:
                client.put(1, b"warm")  # connect to both nodes before one stalls
                client.put(2, b"warm")
                batches = [(list(range(100 * b, 100 * b + 8)), _values(rng, 8, 8192))
                           for b in range(1, 3)]
                os.kill(s0.proc.pid, signal.SIGSTOP)
                timer = threading.Timer(1.0, os.kill, (s0.proc.pid, signal.SIGCONT))
                timer.start()
                try:
                    for keys, vals in batches:  # puts take turns: one of them goes to s0
                        client.batch_put(keys, vals)
                finally:
                    timer.join()
                    os.kill(s0.proc.pid, signal.SIGCONT)
                assert master.counters["nodes_dropped"] >= 1
                for keys, vals in batches:
                    assert client.batch_get(keys) == vals
                deadline = time.monotonic() + 10
                while "s0" not in master.stats()["nodes"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert "s0" in master.stats()["nodes"], "the stalled node rejoins"


def test_put_without_waiting_is_seen_in_order_and_its_failures_come_at_flush() -> None:
    rng = np.random.default_rng(19)
    with Master(put_timeout_s=0.2, node_interval=0.1, node_max_missed=50) as master:
        with NodeProcess(master.endpoint, "w0", 16 << 20) as w0:
            master.wait_nodes(1)
            with Client(master.endpoint) as client, Client(master.endpoint) as other:
                vals = _values(rng, 8)
                with master._lock:  # 0.2 s for the stalled put below, not for this one
                    master.put_timeout_s = 10.0
                client.batch_put(range(8), vals, wait=False)
                # the commit goes before this client's next request
                assert client.batch_get(range(8)) == vals
                client.flush()
                assert other.batch_get(range(8)) == vals
                # the node stalls past the put's deadline: the write is given up, and the
                # commit stores nothing; the put returned, flush names the keys (once)
                with master._lock:
                    master.put_timeout_s = 0.2
                os.kill(w0.proc.pid, signal.SIGSTOP)
                timer = threading.Timer(0.6, os.kill, (w0.proc.pid, signal.SIGCONT))
                timer.start()
                try:
                    client.batch_put(range(100, 104), vals[:4], wait=False)
                finally:
                    timer.join()
                    os.kill(w0.proc.pid, signal.SIGCONT)
                with pytest.raises(PutError) as caught:
                    client.flush()
                assert sorted(caught.value.keys) == [100, 101, 102, 103]  # type: ignore[type-var]
                client.flush()
                assert client.stats()["late_put_failures"] == 0
                assert other.batch_get(range(100, 104)) == [None] * 4
                assert other.batch_get(range(8)) == vals


def test_get_into_after_the_remembered_node_died_reads_the_other_replica() -> None:
    rng = np.random.default_rng(20)
    with Master(lease_s=5.0, node_interval=0.1, node_max_missed=50) as master:
        with NodeProcess(master.endpoint, "g0", 32 << 20) as g0, \
                NodeProcess(master.endpoint, "g1", 32 << 20):
            master.wait_nodes(2)
            with Client(master.endpoint, timeout=5.0) as client:
                vals = _values(rng, 12, 100_000)
                dst = np.zeros(12 * 100_000, dtype=np.uint8)
                client.register_buffer(dst)
                views = [dst[i * 100_000:(i + 1) * 100_000] for i in range(12)]
                client.batch_put(range(12), vals, replicas=2)
                assert client.get_into(range(12), views) == [len(v) for v in vals]
                g0.kill()  # every key's first replica, or its second, was there
                for _ in range(3):
                    dst.fill(0)
                    got = client.get_into(range(12), views)
                    assert got == [len(v) for v in vals]
                    assert [views[i][:n].tobytes() for i, n in enumerate(got)] == vals


def test_master_restart_rebuilds_from_nodes() -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    rng = np.random.default_rng(7)
    vals = _values(rng, 50)
    opts = dict(lease_s=0.5, put_timeout_s=1.0, grace_s=1.0, node_interval=0.1)
    master = Master(endpoint, **opts)  # type: ignore[arg-type]
    nodes = [StorageNode(endpoint, 8 << 20, name=f"r{i}") for i in range(2)]
    try:
        master.wait_nodes(2)
        with Client(endpoint, replicas=2, checksum=True, timeout=3.0) as client:
            client.batch_put(range(50), vals)
            client.batch_put(range(10), vals[10:20])  # newer versions of keys 0..9
            client.batch_remove(range(40, 50))
            time.sleep(0.3)  # let the journal reach the nodes
            master.close()
            with pytest.raises(MasterUnavailableError):
                client.get(1)
            master = Master(endpoint, **opts)  # type: ignore[arg-type]
            master.wait_nodes(2, ready=False)
            assert master.stats()["objects"] == 40
            want = vals[10:20] + vals[10:40] + [None] * 10
            assert client.batch_get(range(50), verify=True) == want
            with pytest.raises(PutError, match="RECOVERING"):
                client.put(1000, b"too early")  # the grace period guards old writers
            master.wait_nodes(2)
            client.put(1000, b"later")
            assert client.get(1000) == b"later"
    finally:
        for node in nodes:
            node.close()
        master.close()


def test_a_key_removed_under_a_readers_lease_stays_removed_after_a_master_restart(
        ) -> None:
    """A reader's lease keeps a removed key's space (it may still be reading), so the
    space is freed later; the node is told at once that the object is gone, and a
    master restarted meanwhile never publishes it again (it came back before). Its
    space is freed once the new master's lease has passed."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    opts = dict(lease_s=5.0, put_timeout_s=1.0, grace_s=0.3, node_interval=0.1)
    master = Master(endpoint, **opts)  # type: ignore[arg-type]
    node = StorageNode(endpoint, 4 << 20, name="n0")
    try:
        master.wait_nodes(1)
        value = np.random.default_rng(3).bytes(1000)
        with Client(endpoint, timeout=3.0) as writer, Client(endpoint, timeout=3.0) as reader:
            writer.put("k", value)
            writer.put("kept", value[::-1])
            assert reader.get("k") == value  # its lease lasts until its next request
            assert writer.remove("k") is True
            assert writer.get("k") is None
            time.sleep(0.4)  # the journal reaches the node
            master.close()
            master = Master(endpoint, **opts)  # type: ignore[arg-type]
            master.wait_nodes(1)
            with Client(endpoint, timeout=3.0) as fresh:
                assert fresh.get("k") is None
                assert fresh.get("kept") == value[::-1]
                assert master.stats()["objects"] == 1
    finally:
        node.close()
        master.close()


def test_a_ttl_outlives_a_master_restart() -> None:
    """Nodes keep each object's TTL (as a time of the epoch) in their directories: a
    restarted master expires a key when its TTL ends, not never, and a key whose TTL
    ended while no master ran is not published again."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    opts = dict(lease_s=0.3, put_timeout_s=1.0, grace_s=0.3, node_interval=0.1)
    master = Master(endpoint, **opts)  # type: ignore[arg-type]
    node = StorageNode(endpoint, 4 << 20, name="n0")
    try:
        master.wait_nodes(1)
        with Client(endpoint, timeout=3.0) as client:
            client.put("soon", b"gone at 0.3 s", ttl=0.3)
            client.put("later", b"gone at 3 s", ttl=3.0)
            client.put("kept", b"no ttl")
            time.sleep(0.2)  # the journal reaches the node
            master.close()
            time.sleep(0.3)  # "soon" ends while no master runs
            master = Master(endpoint, **opts)  # type: ignore[arg-type]
            master.wait_nodes(1)
            assert client.get("soon") is None
            assert client.get("later") == b"gone at 3 s"
            deadline = time.monotonic() + 8
            while client.get("later") is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get("later") is None and client.get("kept") == b"no ttl"
            assert master.stats()["objects"] == 1
    finally:
        node.close()
        master.close()


def test_authentication_and_bad_messages() -> None:
    with Master(auth=SECRET) as master:
        with StorageNode(master.endpoint, 4 << 20, auth=SECRET):
            master.wait_nodes(1)
            with Client(master.endpoint, auth=SECRET) as client:
                client.put(1, b"signed")
                assert client.get(1) == b"signed"
            with Client(master.endpoint, timeout=2.0) as outsider, \
                    pytest.raises(AuthenticationError):
                outsider.get(1)
            ctx = zmq.Context()
            try:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(master.endpoint)
                for junk in (b"", b"\x00" * 100, os.urandom(3000)):
                    sock.send(junk)
                    assert sock.poll(2000)
                    sock.recv()
                sock.close()
            finally:
                ctx.term()
            with Client(master.endpoint, auth=SECRET) as client:
                assert client.get(1) == b"signed"  # the master kept serving


def test_lookup_and_segments_registered_elsewhere(cluster: tuple[Master, list[StorageNode]]
                                                  ) -> None:
    """A lookup answers what is stored with no engine; a client moves values straight
    from and into memory its engine registered for other transfers (a KV cache)."""
    from kvstore.client import Lookup
    from transfer_engine import Engine

    master, _ = cluster
    keys = [int(k) for k in block_hashes(np.arange(64), 16, key_bytes=16, salt=b"t")
            .view(np.uint64).reshape(-1, 2)[:, 0]]
    src = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    with Engine("kv-owner") as engine, Client(master.endpoint, engine=engine) as client, \
            Lookup(master.endpoint) as lookup:
        seg_src, seg_dst = engine.register(src), engine.register(dst)
        assert client.register_buffer(seg_src) is seg_src
        client.register_buffer(seg_dst)
        addr = int(src.ctypes.data)
        client.put_from_addresses(keys[:3], [addr, addr + 1024, addr + 2048], [1024] * 3)
        assert lookup.longest_prefix(keys) == 3
        assert lookup.batch_exists(keys).tolist() == [True, True, True, False]
        base = int(dst.ctypes.data)
        assert client.get_into_addresses(keys[:3], [base, base + 1024, base + 2048],
                                         [1024] * 3) == [1024] * 3
        assert np.array_equal(src[:3072], dst[:3072])
        with Engine("kv-other") as other:
            with pytest.raises(InvalidArgumentError, match="not an open segment"):
                client.register_buffer(other.register(np.zeros(16, dtype=np.uint8)))
    with pytest.raises(StoreError, match="closed"):
        lookup.batch_exists(keys)
