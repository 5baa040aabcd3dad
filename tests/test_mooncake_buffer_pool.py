"""Mooncake's ``BufferPool`` on our store: leases of registered memory for zero-copy
``get_into`` / ``put_from``, with Mooncake's limits, waits and errors (the behaviours its
own ``test_buffer_pool_native.py`` checks), through ``kvstore`` and the ``mooncake`` shim."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.buffer_pool import BufferLease, BufferPool, RegisteredBufferPool, _Buddy
from kvstore.master import Master
from kvstore.mooncake_store import ErrorCode, MooncakeDistributedStore
from tests.helpers.faults import holding_lock

ROOT = Path(__file__).resolve().parent.parent
LOCAL = 4 << 20  # the store's local_buffer_size, as in Mooncake's test


@pytest.fixture
def master_addr() -> Iterator[str]:
    """A master per test: one outliving a test's stores would place data on them."""
    with Master() as master:
        yield master.endpoint.split("://", 1)[1]


@pytest.fixture
def store(master_addr: str) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, LOCAL, "tcp", "",
                   master_addr) == 0
    yield s
    s.close()


def _one_region(store: MooncakeDistributedStore, **kwargs: object) -> BufferPool:
    return BufferPool(store, min_size_class=4096, max_size_class=4096, alignment=4096,
                      max_regions=1, **kwargs)  # type: ignore[arg-type]


def test_released_memory_is_leased_again(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, min_size_class=4096, alignment=4096)
    lease = pool.acquire(1234)
    lease.buffer[:4] = b"abcd"
    assert bytes(lease.buffer[:4]) == b"abcd"
    first = lease.ptr
    lease.release()
    again = pool.acquire(2048)
    assert again.ptr == first  # the same block, back from its free list
    again.release()
    pool.close()


def test_defaults_lease_from_the_local_area(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store)
    lease = pool.acquire(1024)
    assert lease.size == 1024 and len(lease.buffer) == 1024
    assert lease.buffer.format == "B" and not lease.buffer.readonly
    lease.release()
    with pool.buffer(10) as held:
        assert held.size == 10
    with pytest.raises(RuntimeError, match="closed"):
        _ = held.ptr
    pool.close()


def test_a_full_local_area_overflows(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store)  # max_bytes: twice the local area
    local = pool.acquire(LOCAL)
    overflow = pool.acquire(1024, block=False)
    assert overflow.size == 1024
    assert not local.ptr <= overflow.ptr < local.ptr + LOCAL
    overflow.buffer[:] = b"x" * 1024  # its own registered memory
    assert store.put_from("overflowed", overflow.ptr, 1024) == 0
    overflow.release()
    local.release()
    pool.close()


def test_requests_above_max_size_class_get_their_own_buffer(
        store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, 1 << 20, max_size_class=128 * 1024, alignment=4096)
    small = pool.acquire(128 * 1024)
    registered = len(store.registered_buffers)
    big = pool.acquire(128 * 1024 + 1)
    assert big.ptr % 4096 == 0 and len(store.registered_buffers) == registered + 1
    big.release()
    small.release()
    pool.close()


def test_prewarm_then_leases(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, 1 << 20, min_size_class=4096, alignment=4096,
                      prewarm_size=1024, prewarm_count=2)
    a, b = pool.acquire(1024), pool.acquire(1024)
    assert a.ptr != b.ptr
    a.release()
    b.release()
    pool.prewarm(LOCAL * 4, 3)  # more than the area holds: a no-op, as in Mooncake
    pool.close()


def test_lease_addresses_are_aligned(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, min_size_class=4096, alignment=65536)
    leases = [pool.acquire(1024) for _ in range(4)]
    assert all(lease.ptr % 4096 == 0 for lease in leases)  # blocks of the size class
    assert len({lease.ptr for lease in leases}) == 4
    for lease in leases:
        lease.release()
    pool.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"alignment": 12345}, "alignment"),
    ({"alignment": 4}, "alignment"),
    ({"alignment": 0}, "positive"),
    ({"min_size_class": 0}, "positive"),
])
def test_bad_arguments_are_refused(store: MooncakeDistributedStore, kwargs: dict[str, int],
                                   match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        BufferPool(store, 1 << 20, **kwargs)


def test_a_store_without_setup_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(None)


def test_a_store_without_local_buffer_is_refused(master_addr: str) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master_addr) == 0
    try:
        with pytest.raises(RuntimeError, match="local buffer"):
            BufferPool(s)
    finally:
        s.close()


@pytest.mark.parametrize("size", [0, 1, 128 * 1024 + 1])
def test_any_size_is_leased(store: MooncakeDistributedStore, size: int) -> None:
    pool = BufferPool(store, 1 << 20, max_size_class=128 * 1024, alignment=4096)
    lease = pool.acquire(size)
    assert lease.size == size and len(lease.buffer) == size
    lease.release()
    pool.close()


def test_exhaustion_without_blocking_raises(store: MooncakeDistributedStore) -> None:
    pool = _one_region(store, block_on_exhaustion=False)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    lease.release()
    pool.acquire(1).release()
    pool.close()


def test_max_bytes_bounds_local_and_overflow(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, LOCAL + 8192, min_size_class=4096, alignment=4096)
    local = pool.acquire(LOCAL)
    extra = pool.acquire(8192, block=False)  # overflow, up to max_bytes
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1, block=False)
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1, timeout=0.05)
    extra.release()
    local.release()
    pool.close()


def test_timeout_waits_for_a_release(store: MooncakeDistributedStore) -> None:
    pool = _one_region(store)
    lease = pool.acquire(1)
    got: list[BufferLease] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1, timeout=5.0)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting
    lease.release()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and len(got) == 1
    got[0].release()
    with pytest.raises(RuntimeError, match="non-negative"):
        pool.acquire(1, timeout=-1)
    pool.close()


def test_blocking_acquire_lets_other_threads_run(store: MooncakeDistributedStore) -> None:
    pool = _one_region(store, default_timeout=None)
    lease = pool.acquire(1)
    got: list[BufferLease] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1)))
    waiter.start()
    time.sleep(0.1)  # this thread runs while the waiter blocks
    lease.release()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    got[0].release()
    pool.close()


def test_default_timeout(store: MooncakeDistributedStore) -> None:
    pool = _one_region(store, default_timeout=0.05)
    lease = pool.acquire(1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1)
    assert time.monotonic() - start >= 0.04
    lease.release()
    pool.close()


def test_views_keep_the_lease(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, 4096, min_size_class=4096, alignment=4096)
    lease = pool.acquire(4)
    view = lease.buffer
    view[:] = b"test"
    assert bytes(view) == b"test"
    part = view[1:3]
    array = np.frombuffer(view, dtype=np.uint8)
    del view
    for still_there in (part, array):
        with pytest.raises(RuntimeError, match="exported views"):
            lease.release()
        del still_there
    del part, array
    gc.collect()
    lease.release()
    lease.release()  # a second release does nothing
    with pytest.raises(BufferError, match="closed"):
        _ = lease.buffer
    pool.close()


def test_a_dropped_lease_goes_back(store: MooncakeDistributedStore) -> None:
    pool = _one_region(store, block_on_exhaustion=False)
    lease = pool.acquire(1)
    del lease
    gc.collect()
    pool.acquire(1).release()  # the region is free again
    pool.close()


def test_a_lease_collected_inside_the_pools_lock(store: MooncakeDistributedStore) -> None:
    """The garbage collector may end a lease while this thread runs the pool's locked
    code; that release waits for the next acquire or close instead of changing the
    pool's state mid-operation."""
    pool = BufferPool(store, min_size_class=4096, alignment=4096,
                      block_on_exhaustion=False)
    local = pool.acquire(LOCAL)
    overflow = pool.acquire(1)  # the area is full: an overflow buffer
    registered = len(store.registered_buffers)
    with holding_lock(pool):
        del local, overflow
        gc.collect()
        assert pool.active_leases == 2  # not yet
    pool.acquire(LOCAL).release()  # both came back on the way in
    assert len(store.registered_buffers) == registered - 1
    pool.close()


def test_close_refuses_active_leases(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, 1 << 20, min_size_class=4096, alignment=4096)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    pool.acquire(1).release()  # still open
    lease.release()
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_huge_sizes_are_refused(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, 1 << 20, min_size_class=4096, alignment=4096)
    with pytest.raises(RuntimeError, match="overflow|capacity"):
        pool.acquire((1 << 64) - 1)
    with pytest.raises(TypeError):
        pool.acquire(-1)
    pool.close()


def test_close_unregisters_the_local_area(store: MooncakeDistributedStore) -> None:
    before = dict(store.registered_buffers)
    pool = BufferPool(store, min_size_class=4096, alignment=4096)
    assert len(store.registered_buffers) == len(before) + 1
    local = pool.acquire(LOCAL)
    overflow = pool.acquire(100)
    assert len(store.registered_buffers) == len(before) + 2
    overflow.release()
    local.release()
    assert len(store.registered_buffers) == len(before) + 1
    pool.close()
    assert store.registered_buffers == before


def test_leases_under_many_threads(store: MooncakeDistributedStore) -> None:
    pool = BufferPool(store, LOCAL, min_size_class=4096, alignment=4096, max_regions=6)
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 512 * 1024, 200).tolist()
    errors: list[BaseException] = []

    def work(part: list[int], tag: int) -> None:
        try:
            for size in part:
                with pool.acquire(size, timeout=10) as lease:
                    view = lease.buffer
                    view[:] = bytes([tag]) * size
                    assert view.tobytes() == bytes([tag]) * size  # nobody else's block
                    del view
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(sizes[i::8], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    pool.acquire(LOCAL, block=False).release()  # every block merged back into one
    pool.close()


def test_zero_copy_round_trip_through_leases(store: MooncakeDistributedStore,
                                             master_addr: str) -> None:
    reader = MooncakeDistributedStore()
    assert reader.setup("127.0.0.1", "P2PHANDSHAKE", 0, LOCAL, "tcp", "",
                        master_addr) == 0
    writer_pool = BufferPool(store)
    reader_pool = BufferPool(reader)
    try:
        payload = np.random.default_rng(7).bytes(3 * 1024 * 1024 + 17)
        with writer_pool.buffer(len(payload)) as lease:
            view = lease.buffer
            view[:] = payload
            del view
            assert store.put_from("bufpool/round-trip", lease.ptr, lease.size) == 0
        with reader_pool.buffer(len(payload) + 100) as lease:
            n = reader.get_into("bufpool/round-trip", lease.ptr, lease.size)
            assert n == len(payload)
            view = lease.buffer[:n]
            assert view.tobytes() == payload
            del view
            assert reader.get_into("bufpool/missing", lease.ptr, lease.size) == \
                ErrorCode.OBJECT_NOT_FOUND
    finally:
        reader_pool.close()
        writer_pool.close()
        reader.close()


@pytest.mark.parametrize("area", [1 << 20, (1 << 20) + (3 << 12) + 100])
def test_blocks_never_overlap_and_merge_back(area: int) -> None:
    buddy = _Buddy(area, 4096)
    rng = np.random.default_rng(area)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.45:
            offset = list(held)[int(rng.integers(len(held)))]
            del held[offset]
            buddy.free(offset)
            continue
        order = buddy.order_for(int(rng.integers(1, 200_000)))
        offset = buddy.alloc(order)
        if offset is None:
            continue
        assert offset % (1 << order) == 0 and offset + (1 << order) <= area
        for other, other_order in held.items():
            assert offset + (1 << order) <= other or other + (1 << other_order) <= offset
        held[offset] = order
    for offset in list(held):
        buddy.free(offset)
    assert buddy.alloc(buddy.max_order) == 0  # whole again


def test_mooncake_names_in_the_shim() -> None:
    shim = ROOT / "transfer_engine" / "connectors" / "mooncake" / "shim"
    code = ("import mooncake, mooncake.store, mooncake.buffer_pool as bp\n"
            "from mooncake import BufferPool, RegisteredBufferPool\n"
            "from kvstore.buffer_pool import BufferPool as Ours\n"
            "assert BufferPool is RegisteredBufferPool is bp.BufferPool is Ours\n"
            "assert bp.RegisteredBufferPool is mooncake.store.RegisteredBufferPool\n"
            "assert mooncake.store.BufferLease.__name__ == 'BufferLease'\n"
            "assert mooncake.store.RegisteredBufferLeaseView is "
            "mooncake.store.BufferLeaseView\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert RegisteredBufferPool is BufferPool
