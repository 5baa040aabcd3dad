"""The store's tiers: the client's local DRAM tier (versions keep it from serving stale
values), a node's disk pool (demotion on eviction, promotion on hit, bounded), and the
device block pool (a CPU tensor stands in for GPU memory here; the ``gpu`` test uses
CUDA). Random bytes throughout, checked byte for byte."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.fleet import free_port
from kvstore import KVStore
from kvstore.client import Client
from kvstore.device_pool import DevicePool
from kvstore.errors import ValueTooLargeError
from kvstore.master import Master
from kvstore.node import StorageNode
from tests.helpers.cluster_helpers import NodeProcess
from tests.helpers.faults import SlowCopyNode, holding_lock, local_tier


def _values(rng: np.random.Generator, n: int, size: int) -> list[bytes]:
    """Random values of 1..size bytes, none all zeros."""
    out = []
    for _ in range(n):
        v = rng.integers(1, 256, int(rng.integers(1, size + 1)), dtype=np.uint8)
        out.append(v.tobytes())
    return out


def _wait(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def master() -> Iterator[Master]:
    with Master(lease_s=2.0, put_timeout_s=3.0, node_interval=0.1,
                node_max_missed=25) as m:
        yield m


@pytest.fixture
def two_nodes(master: Master) -> Iterator[list[StorageNode]]:
    nodes = [StorageNode(master.endpoint, 8 << 20, name=f"n{i}") for i in range(2)]
    try:
        master.wait_nodes(2)
        yield nodes
    finally:
        for node in nodes:
            node.close()


# -- the local DRAM tier -----------------------------------------------------------------


def test_local_tier_hits_promotes_and_is_byte_exact(master: Master,
                                                    two_nodes: list[StorageNode]) -> None:
    rng = np.random.default_rng(11)
    keys = [int(k) for k in rng.integers(1, 2**63, 30)]
    vals = _values(rng, 30, 50_000)
    with Client(master.endpoint, checksum=True) as writer, \
            Client(master.endpoint, local_cache_bytes=8 << 20) as reader:
        writer.batch_put(keys, vals)
        assert reader.batch_get(keys, verify=True) == vals  # remote, then promoted
        st = reader.stats()
        assert (st["remote_hits"], st["promotions"], st["local_hits"]) == (30, 30, 0)
        assert reader.batch_get(keys, verify=True) == vals  # local
        assert [reader.get(k, verify=True) for k in keys[:5]] == vals[:5]
        st = reader.stats()
        assert (st["remote_hits"], st["local_hits"]) == (30, 35)
        # zero-copy gets are served from the local tier too
        buf = np.zeros(sum(len(v) for v in vals) + 64 * 30, dtype=np.uint8)
        with reader.register_buffer(buf):
            offs = np.cumsum([0] + [len(v) + 64 for v in vals[:-1]])
            views = [buf[o:o + len(v)] for o, v in zip(offs, vals, strict=True)]
            assert reader.get_into(keys, views, verify=True) == [len(v) for v in vals]
            assert all(bytes(w) == v for w, v in zip(views, vals, strict=True))
        assert reader.stats()["local_hits"] == 65
        assert reader.get(12345) is None


def test_put_writes_through_and_remove_invalidates(master: Master,
                                                    two_nodes: list[StorageNode]) -> None:
    rng = np.random.default_rng(12)
    vals = _values(rng, 8, 20_000)
    with Client(master.endpoint, local_cache_bytes=4 << 20, replicas=2) as c:
        c.batch_put(range(1, 9), vals)
        st = c.stats()
        assert st["local_writes"] == 8 and st["local_entries"] == 8
        assert c.batch_get(range(1, 9)) == vals
        assert c.stats()["local_hits"] == 8 and c.stats()["remote_hits"] == 0
        assert c.remove(3)
        assert c.get(3) is None
        assert c.stats()["local_entries"] == 7
    with Client(master.endpoint) as other:  # the cluster has the bytes too
        got = other.batch_get(range(1, 9))
        assert got[2] is None and [g for i, g in enumerate(got) if i != 2] == \
            [v for i, v in enumerate(vals) if i != 2]


def test_another_clients_overwrite_or_remove_is_never_served_stale(
        master: Master, two_nodes: list[StorageNode]) -> None:
    rng = np.random.default_rng(13)
    keys = list(range(100, 120))
    old = _values(rng, 20, 30_000)
    new = _values(rng, 20, 30_000)
    with Client(master.endpoint, local_cache_bytes=8 << 20) as a, \
            Client(master.endpoint, local_cache_bytes=8 << 20) as b:
        a.batch_put(keys, old)
        assert b.batch_get(keys) == old  # b caches every key
        assert b.batch_get(keys) == old and b.stats()["local_hits"] == 20
        a.batch_put(keys[:10], new[:10])  # overwritten by a
        assert a.batch_remove(keys[10:15]).all()  # removed by a
        got = b.batch_get(keys)
        assert got[:10] == new[:10]
        assert got[10:15] == [None] * 5
        assert got[15:] == old[15:]
        st = b.stats()
        assert st["local_stale"] == 15
        assert st["local_hits"] == 20 + 5
        # b now holds the new versions; its own overwrite replaces its copy too
        b.put(keys[0], b"\x07" * 99)
        assert a.get(keys[0]) == b"\x07" * 99 and b.get(keys[0]) == b"\x07" * 99


def test_local_tier_evicts_under_pressure_and_loses_nothing(
        master: Master, two_nodes: list[StorageNode]) -> None:
    rng = np.random.default_rng(14)
    vals = _values(rng, 120, 40_000)
    with Client(master.endpoint, local_cache_bytes=1 << 20,
                local_max_value_bytes=64 << 10, checksum=True) as c:
        for s in range(0, 120, 20):
            c.batch_put(range(s, s + 20), vals[s:s + 20])
        for _ in range(2):
            assert c.batch_get(range(120), verify=True) == vals
        st = c.stats()
        assert st["local_evictions"] > 0
        assert st["local_entries"] < 120
        assert st["local_hits"] + st["remote_hits"] == 240
        assert st["remote_hits"] > 0


def test_corrupt_local_copy_is_dropped_with_verify(master: Master,
                                                   two_nodes: list[StorageNode]) -> None:
    rng = np.random.default_rng(15)
    val = _values(rng, 1, 10_000)[0]
    with Client(master.endpoint, local_cache_bytes=1 << 20, checksum=True) as c:
        c.put(7, val)
        tier = local_tier(c)
        assert tier is not None
        view = tier.store.get(7)
        assert view is not None
        byte = ctypes.c_uint8.from_address(np.frombuffer(view, np.uint8).ctypes.data + 8 + 5)
        byte.value ^= 0xFF  # flip a byte of the local copy (after its 8-byte version)
        del view, byte
        assert c.get(7, verify=True) == val
        st = c.stats()
        assert st["remote_hits"] == 1 and st["local_hits"] == 0


# -- a node's disk tier --------------------------------------------------------------------


def _disk_node(master: Master, tmp_path: Path, dram: int, disk: int) -> StorageNode:
    node = StorageNode(master.endpoint, dram, name="d0", disk_path=str(tmp_path / "spill"),
                       disk_capacity=disk)
    master.wait_nodes(1)
    return node


def test_eviction_demotes_to_disk_and_gets_promote_back(master: Master,
                                                        tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    vals = [rng.integers(1, 256, 60_000, dtype=np.uint8).tobytes() for _ in range(40)]
    with _disk_node(master, tmp_path, 1 << 20, 4 << 20) as node, \
            Client(master.endpoint, checksum=True) as c:
        for i, v in enumerate(vals):  # 2.4 MB into 1 MiB of DRAM
            c.put(i, v)
        st = c.stats()
        assert st["demotions"] > 0 and st.get("evictions", 0) == 0
        assert st["objects"] == 40
        pools = {p["tier"]: p for p in st["pools"]}
        assert pools["disk"]["free"] < pools["disk"]["capacity"]
        _wait(lambda: c.stats()["pending_moves"] == 0)
        on_disk = [i for i in range(40) if "disk" in node.object_pool(i)]
        assert on_disk
        # the demoted bytes are in the spill file, byte for byte
        spill = (tmp_path / "spill").read_bytes()
        with holding_lock(node):
            entries = list(node.directory.items())
        for (pool, off), e in entries:
            if pool == 1:
                key = e[0] | e[1] << 64
                assert spill[off:off + e[4]] == vals[key]
        assert c.batch_get(range(40), verify=True) == vals
        st = c.stats()
        assert st["disk_hits"] >= len(on_disk) and st["remote_hits"] == 40
        # a hit promoted some back to DRAM (there was room after the last demotions)
        _wait(lambda: c.stats()["pending_moves"] == 0)
        assert c.batch_get(range(40), verify=True) == vals
        assert c.stats().get("disk_promotions", 0) >= 0
        assert node.copy_failures == 0


def test_disk_hit_promotes_when_dram_has_room(master: Master, tmp_path: Path) -> None:
    rng = np.random.default_rng(22)
    vals = [rng.integers(1, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(16)]
    with _disk_node(master, tmp_path, 1 << 20, 4 << 20) as node, \
            Client(master.endpoint) as c:
        for i, v in enumerate(vals):
            c.put(i, v)
        _wait(lambda: c.stats()["pending_moves"] == 0)
        demoted = [i for i in range(16) if "disk" in node.object_pool(i)]
        assert demoted
        kept = [i for i in range(16) if i not in demoted]
        assert c.batch_remove(kept).all()  # DRAM room again
        _wait(lambda: {p["tier"]: p["free"] for p in c.stats()["pools"]}["dram"] > 500_000)
        k = demoted[0]
        assert c.get(k) == vals[k]  # read from disk, promoted
        _wait(lambda: c.stats().get("disk_promotions", 0) >= 1)
        _wait(lambda: node.object_pool(k) == ["dram"])
        assert c.get(k) == vals[k]
        st = c.stats()
        assert st["disk_hits"] == 1


def test_full_disk_evicts_but_never_returns_wrong_bytes(master: Master,
                                                        tmp_path: Path) -> None:
    rng = np.random.default_rng(23)
    vals = [rng.integers(1, 256, 50_000, dtype=np.uint8).tobytes() for _ in range(80)]
    with _disk_node(master, tmp_path, 512 << 10, 1 << 20) as node, \
            Client(master.endpoint, checksum=True) as c:
        for i, v in enumerate(vals):  # 4 MB into 1.5 MiB of DRAM + disk
            c.put(i, v)
        st = c.stats()
        assert st["demotions"] > 0 and st["evictions"] > 0
        for p in st["pools"]:
            assert 0 <= p["free"] <= p["capacity"]
        assert (tmp_path / "spill").stat().st_size == 1 << 20
        got = c.batch_get(range(80), verify=True)
        assert all(g is None or g == v for g, v in zip(got, vals, strict=True))
        assert got[-1] == vals[-1]
        assert sum(g is not None for g in got) >= 20
        assert node.copy_failures == 0


def test_demotion_takes_least_recently_used_and_answers_parked_put(
        master: Master, tmp_path: Path) -> None:
    rng = np.random.default_rng(29)
    vals = [rng.integers(1, 256, 50_000, dtype=np.uint8).tobytes() for _ in range(11)]
    with _disk_node(master, tmp_path, 512 << 10, 1 << 20) as node, \
            Client(master.endpoint) as c:
        for i in range(10):  # DRAM full
            c.put(i, vals[i])
        assert c.get(0) == vals[0] and c.get(1) == vals[1]  # the oldest, used again
        c.put(10, vals[10])  # parked until a demotion frees DRAM
        _wait(lambda: c.stats()["pending_moves"] == 0)
        st = c.stats()
        assert st["puts_parked"] >= 1 and st["demotions"] >= 1
        assert "disk" in node.object_pool(2)  # least recently used: demoted, not dropped
        assert node.object_pool(0) == ["dram"] and node.object_pool(1) == ["dram"]
        _wait(lambda: node.object_pool(10) == ["dram"])
        assert st.get("evictions", 0) == 0
        assert c.batch_get(range(11)) == vals


def test_remove_and_overwrite_of_demoted_objects(master: Master, tmp_path: Path) -> None:
    rng = np.random.default_rng(24)
    vals = [rng.integers(1, 256, 60_000, dtype=np.uint8).tobytes() for _ in range(30)]
    with _disk_node(master, tmp_path, 1 << 20, 4 << 20) as node, \
            Client(master.endpoint, local_cache_bytes=4 << 20) as c, \
            Client(master.endpoint, local_cache_bytes=4 << 20) as other:
        for i, v in enumerate(vals):
            c.put(i, v)
        assert other.batch_get(range(30)) == vals
        _wait(lambda: c.stats()["pending_moves"] == 0)
        demoted = [i for i in range(30) if "disk" in node.object_pool(i)]
        assert len(demoted) >= 2
        a, b = demoted[:2]
        assert c.remove(a)
        c.put(b, b"\x01\x02\x03")
        got = other.batch_get(range(30))
        assert got[a] is None and got[b] == b"\x01\x02\x03"
        assert [g for i, g in enumerate(got) if i not in (a, b)] == \
            [v for i, v in enumerate(vals) if i not in (a, b)]


# -- the device block pool ----------------------------------------------------------------


def test_device_pool_promotes_and_demotes_through_a_store() -> None:
    rng = np.random.default_rng(31)
    vals = _values(rng, 12, 4096)
    with KVStore(1 << 20) as dram, DevicePool(4, 4096, lower=dram, device="cpu") as gpu:
        for i, v in enumerate(vals):
            gpu.put(i, v)
        assert len(gpu) == 4
        st = gpu.stats()
        assert st["device_evictions"] == 8 and st["device_demotions"] == 8
        assert len(dram) == 8  # the evicted dirty blocks, nothing lost
        for i, v in enumerate(vals):
            assert gpu.get_bytes(i) == v
        st = gpu.stats()
        assert st["lower_hits"] >= 8 and st["device_promotions"] >= 8
        assert st["device_hits"] + st["device_misses"] == 12
        assert gpu.get_bytes(999) is None
        assert gpu.demotions == 12  # 8..11 were still dirty when the gets evicted them
        # promoted blocks are clean: evicting them again writes nothing
        for i in range(8):
            gpu.get(i)
        assert gpu.demotions == 12 and gpu.evictions > 12
        for i, v in enumerate(vals):
            assert bytes(dram.get(i) or b"") == v
        gpu.put(3, b"\x05" * 10)  # dirty again
        assert gpu.flush() == 1 and bytes(dram.get(3) or b"") == b"\x05" * 10
        with pytest.raises(ValueTooLargeError):
            gpu.put(50, b"\x01" * 4097)
        assert "DevicePool" in repr(gpu)


def test_device_pool_over_the_cluster_tiers(master: Master, tmp_path: Path) -> None:
    """GPU -> local DRAM -> remote DRAM -> disk, every value back byte for byte."""
    rng = np.random.default_rng(32)
    vals = [rng.integers(1, 256, 64_000, dtype=np.uint8).tobytes() for _ in range(32)]
    with _disk_node(master, tmp_path, 1 << 20, 4 << 20), \
            Client(master.endpoint, local_cache_bytes=512 << 10, checksum=True) as c, \
            DevicePool(4, 64_000, lower=c, device="cpu", write_through=True) as gpu:
        for i, v in enumerate(vals):
            gpu.put(i, v)
        assert gpu.stats()["device_demotions"] == 0  # written through: clean blocks
        for i, v in enumerate(vals):
            assert gpu.get_bytes(i) == v
        st = c.stats()
        assert st["demotions"] > 0 and st["disk_hits"] > 0
        assert st["local_evictions"] > 0
        assert gpu.stats()["lower_hits"] == 32  # LRU: each get evicted a later key
        assert gpu.get_bytes(31) == vals[31] and gpu.stats()["device_hits"] == 1


@pytest.mark.gpu
def test_device_pool_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    rng = np.random.default_rng(33)
    vals = _values(rng, 10, 1 << 16)
    with KVStore(4 << 20) as dram, DevicePool(3, 1 << 16, lower=dram, device="cuda") as gpu:
        assert gpu.blocks.is_cuda
        for i, v in enumerate(vals):
            gpu.put(i, torch.frombuffer(bytearray(v), dtype=torch.uint8).cuda())
        for i, v in enumerate(vals):
            block = gpu.get(i)
            assert block is not None and block.is_cuda
            assert block.cpu().numpy().tobytes() == v
        assert gpu.stats()["device_demotions"] >= 7


def test_restarted_master_finds_demoted_objects(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rng = np.random.default_rng(25)
    vals = [rng.integers(1, 256, 60_000, dtype=np.uint8).tobytes() for _ in range(30)]
    opts = dict(lease_s=0.5, put_timeout_s=1.0, grace_s=0.5, node_interval=0.1,
                node_max_missed=25)
    master = Master(endpoint, **opts)  # type: ignore[arg-type]
    try:
        with _disk_node(master, tmp_path, 1 << 20, 4 << 20) as node, \
                Client(endpoint, checksum=True, timeout=3.0) as c:
            for i, v in enumerate(vals):
                c.put(i, v)
            _wait(lambda: c.stats()["pending_moves"] == 0)
            assert any("disk" in node.object_pool(i) for i in range(30))
            time.sleep(0.3)  # let the journal reach the node
            master.close()
            master = Master(endpoint, **opts)  # type: ignore[arg-type]
            master.wait_nodes(1)
            assert master.stats()["objects"] == 30
            assert c.batch_get(range(30), verify=True) == vals
            assert c.stats()["disk_hits"] > 0
    finally:
        master.close()


def test_node_process_with_a_spill_file(master: Master, tmp_path: Path) -> None:
    rng = np.random.default_rng(26)
    vals = [rng.integers(1, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(24)]
    spill = tmp_path / "spill"
    with NodeProcess(master.endpoint, "p0", capacity=1 << 20,
                     extra=["--disk", str(spill), "--disk-capacity", "4M"]):
        master.wait_nodes(1)
        with Client(master.endpoint, checksum=True) as c:
            c.batch_put(range(12), vals[:12])
            c.batch_put(range(12, 24), vals[12:])
            assert c.batch_get(range(24), verify=True) == vals
            st = c.stats()
            assert st["demotions"] > 0 and st["disk_hits"] > 0
        assert spill.stat().st_size == 4 << 20


def test_overwrite_during_a_promotion_wins(master: Master, tmp_path: Path) -> None:
    rng = np.random.default_rng(27)
    vals = [rng.integers(1, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(16)]
    with SlowCopyNode(master.endpoint, 1 << 20, name="s0", disk_path=str(tmp_path / "s"),
                      disk_capacity=4 << 20) as node, Client(master.endpoint) as c:
        master.wait_nodes(1)
        for i, v in enumerate(vals):
            c.put(i, v)
        _wait(lambda: c.stats()["pending_moves"] == 0)
        demoted = [i for i in range(16) if "disk" in node.object_pool(i)]
        assert len(demoted) >= 2
        assert c.batch_remove([i for i in range(16) if i not in demoted]).all()
        _wait(lambda: {p["tier"]: p["free"] for p in c.stats()["pools"]}["dram"] > 500_000)
        node.slow = True
        k, r = demoted[:2]
        assert c.batch_get([k, r]) == [vals[k], vals[r]]  # starts two promotions
        assert c.stats()["pending_moves"] == 2
        c.put(k, b"\x09" * 1000)  # while the node copies
        assert c.remove(r)
        _wait(lambda: c.stats()["pending_moves"] == 0)
        st = c.stats()
        assert st.get("disk_promotions", 0) == 0 and st["disk_hits"] == 2
        assert c.get(k) == b"\x09" * 1000 and c.get(r) is None
        _wait(lambda: node.object_pool(k) == ["dram"] and node.object_pool(r) == [])
        others = [i for i in demoted if i not in (k, r)]
        assert c.batch_get(others) == [vals[i] for i in others]
        assert node.copy_failures == 0
