"""Contracts of the vLLM connector, checked the way vLLM's own connector tests check
them, without starting a vLLM engine: the scheduler side and the worker side are driven
directly, two workers (prefill, decode) in this process with real engines on loopback
and KV caches as CPU torch tensors.

- blocks are held until the decoder has read them, then reported as finished sending;
- a lease that runs out frees blocks nobody read, and decode does not trust a read it
  cannot show finished inside the lease (the blocks may be another request's by then);
- a failed receive is reported as a load error (failed request and its blocks), and a
  dead or slow peer stalls neither ``start_load`` nor the loads from other peers;
- a compatibility mismatch is refused with a message naming what differs;
- no blocks are left held or in flight after many requests;
- block addresses come from the tensor's strides (GPU, CPU and permuted layouts);
- the engine's threads are not pinned to the core vLLM's CPU worker pins its own to.

Requests are ``SimpleNamespace`` objects carrying the attributes the scheduler side
reads (building a real ``vllm.v1.request.Request`` needs a tokenizer and a model
config); block lists are vLLM's own ``KVCacheBlocks``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.clock import FakeClock
from tests.helpers.faults import before_later_reads, early_sent_notes
from tests.helpers.vllm_required import vllm_torch

with warnings.catch_warnings():  # vLLM and torch warn at import; not our concern here
    warnings.simplefilter("ignore")
    torch = vllm_torch()

    from tests.helpers.vllm_workers import (
        COMPAT,
        NUM_BLOCKS,
        block_of,
        cpu_caches,
        gpu_caches,
        mla_caches,
        spec,
        wait_results,
        worker_pair,
    )
    from transfer_engine.connectors.vllm import (
        RecvSpec,
        TEConnectorConfig,
        TEConnectorWorker,
    )
    from transfer_engine.connectors.vllm.blocks import layer_groups
    from transfer_engine.connectors.vllm.config import MANIFEST_SEGMENT, PROTOCOL_VERSION
    from transfer_engine.connectors.vllm.stats import TEConnectorStats

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[Any]:
    with worker_pair(clock) as workers:
        yield workers


# --- blocks where vLLM put them ------------------------------------------------------


@pytest.mark.parametrize("make", [gpu_caches, cpu_caches, mla_caches],
                         ids=["gpu-layout", "cpu-layout", "mla-layout"])
def test_blocks_land_where_vllm_allocated_them(make: Any, clock: FakeClock) -> None:
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    prefill = TEConnectorWorker("p", cfg, COMPAT, clock)
    decode = TEConnectorWorker("d", cfg, COMPAT, clock)
    try:
        pk, dk = make(3), make(4)
        prefill.register_kv_caches(pk, NUM_BLOCKS)
        decode.register_kv_caches(dk, NUM_BLOCKS)
        remote, local = [3, 4, 5, 20], [40, 41, 7, 8]
        prefill.hold({"r": 30.0})
        decode.start_load([spec(prefill, "r", local, remote)])
        res = wait_results(decode, "finished_recving", "r")
        assert not res.failed_recving
        for name in pk:
            for lb, rb in zip(local, remote, strict=True):
                assert torch.equal(block_of(dk[name], lb), block_of(pk[name], rb))
            untouched = make(4)[name]
            assert torch.equal(block_of(dk[name], 0), block_of(untouched, 0))
    finally:
        decode.close()
        prefill.close()


def test_peers_with_other_block_counts_check_ids_against_their_own(
        clock: FakeClock) -> None:
    """Prefill and decode size their KV caches apart (other memory, other models'
    neighbours): each side's block ids are checked against its own cache, and blocks
    move between caches of any sizes."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    prefill = TEConnectorWorker("p", cfg, COMPAT, clock)
    decode = TEConnectorWorker("d", cfg, COMPAT, clock)
    try:
        pk, dk = mla_caches(5, num_blocks=24), mla_caches(6, num_blocks=NUM_BLOCKS)
        prefill.register_kv_caches(pk, 24)
        decode.register_kv_caches(dk, NUM_BLOCKS)
        prefill.hold({"r": 30.0, "bad": 30.0})
        decode.start_load([spec(prefill, "r", [60, 61, 62], [21, 22, 23])])
        assert not wait_results(decode, "finished_recving", "r").failed_recving
        for name in pk:
            for lb, rb in zip([60, 61, 62], [21, 22, 23], strict=True):
                assert torch.equal(dk[name][lb], pk[name][rb])
        # block 30 is inside decode's cache but past the end of prefill's
        decode.start_load([spec(prefill, "bad", [30], [30])])
        assert "bad" in wait_results(decode, "finished_recving", "bad").failed_recving
    finally:
        decode.close()
        prefill.close()


# --- held blocks, leases, load errors, leaks --------------------------------------------


def test_blocks_held_until_sent(pair: Any) -> None:
    prefill, decode, _, _ = pair
    prefill.hold({"req-1": 30.0})
    assert prefill.results().finished_sending == set() and prefill.held == 1
    decode.start_load([spec(prefill, "req-1", [1, 2], [10, 11])])
    wait_results(decode, "finished_recving", "req-1")
    res = wait_results(prefill, "finished_sending", "req-1")
    assert prefill.held == 0 and prefill.stats["sent_requests"] == 1
    assert prefill.results().finished_sending == set()  # reported once
    assert res.finished_recving == set()


@pytest.mark.parametrize("local,remote", [([1, 2], [10, NUM_BLOCKS]),
                                          ([1, 2], [10, 2**62]), ([NUM_BLOCKS, 1], [1, 2])],
                         ids=["remote-past-end", "remote-wraps", "local-past-end"])
def test_block_ids_outside_a_layer_are_load_errors(pair: Any, local: list[int],
                                                   remote: list[int]) -> None:
    """Even ids that would wrap in 64-bit arithmetic: refused before any byte moves."""
    prefill, decode, _, dk = pair
    before = {name: t.clone() for name, t in dk.items()}
    prefill.hold({"far": 30.0})
    decode.start_load([spec(prefill, "far", local, remote)])
    res = wait_results(decode, "finished_recving", "far")
    assert res.failed_recving == {"far"}
    assert decode.take_failed_blocks() == set(local)
    for name, tensor in dk.items():
        assert torch.equal(tensor, before[name])


def test_notification_before_hold_is_not_lost(pair: Any) -> None:
    prefill, decode, _, _ = pair
    # decode may read before prefill's next step hands the hold to its worker
    decode.start_load([spec(prefill, "early", [1], [2])])
    wait_results(decode, "finished_recving", "early")
    prefill.hold({"early": 30.0})
    wait_results(prefill, "finished_sending", "early")


def test_lease_expiry_frees_unsent_blocks(pair: Any, clock: FakeClock) -> None:
    prefill, _, _, _ = pair
    prefill.hold({"a": 5.0, "b": 50.0})
    clock.now += 4.9
    assert prefill.results().finished_sending == set()
    clock.now += 0.2
    assert prefill.results().finished_sending == {"a"}
    clock.now += 100
    assert prefill.results().finished_sending == {"b"}
    assert prefill.stats["lease_expired"] == 2 and prefill.held == 0


def test_reads_outside_the_lease_are_load_errors(pair: Any, clock: FakeClock) -> None:
    prefill, _, _, _ = pair
    wall = FakeClock()
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    decode = TEConnectorWorker("d-wall", cfg, COMPAT, clock, wall_clock=wall)
    try:
        decode.register_kv_caches(gpu_caches(9), NUM_BLOCKS)
        # expired before the read could start: nothing is read
        expired = spec(prefill, "expired", [1], [2])
        expired.lease_expiry = wall.now - 1
        decode.start_load([expired])
        res = wait_results(decode, "finished_recving", "expired")
        assert res.failed_recving == {"expired"} and decode.take_failed_blocks() == {1}
        assert decode.engine is not None
        assert decode.engine.stats["transfers_done"] == 1  # the manifest, no blocks
        # read, but seen finished only after the lease ran out
        late = spec(prefill, "late", [3], [4])
        late.lease_expiry = wall.now + 10
        prefill.hold({"late": 30.0})
        decode.start_load([late])
        wait_results(prefill, "finished_sending", "late")  # the read is complete
        wall.now += 20
        res = decode.results()
        assert res.failed_recving == {"late"} and decode.take_failed_blocks() == {3}
        assert decode.stats["recv_failed"] == 2 and decode.stats["recv_bytes"] == 0
    finally:
        decode.close()


def test_failed_receive_is_a_load_error(pair: Any) -> None:
    prefill, decode, _, _ = pair
    # remote block past the end of the prefill engine's cache
    decode.start_load([spec(prefill, "bad", [5, 6], [1, NUM_BLOCKS + 3])])
    res = wait_results(decode, "finished_recving", "bad")
    assert "bad" in res.finished_recving and "bad" in res.failed_recving
    assert decode.take_failed_blocks() == {5, 6}
    assert decode.take_failed_blocks() == set()
    assert decode.stats["recv_failed"] == 1


def test_dead_peer_stalls_neither_the_step_nor_other_loads(pair: Any) -> None:
    prefill, decode, pk, dk = pair
    # a peer that never answers (a port that accepts and then says nothing): its
    # handshake runs out after timeout_s (2 s) on a background thread while start_load
    # returns at once and a load from a live peer goes through
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        decode.start_load([RecvSpec("dead", [3], [1], dead, "x", "dead")])
        prefill.hold({"live": 30.0})
        decode.start_load([spec(prefill, "live", [4], [7])])
        assert time.monotonic() - started < 1.5
        res = wait_results(decode, "finished_recving", "live")
        assert "dead" not in res.finished_recving and not res.failed_recving
        name = next(iter(pk))
        assert torch.equal(dk[name][:, 4], pk[name][:, 7])
        res = wait_results(decode, "finished_recving", "dead")
    assert res.failed_recving == {"dead"} and decode.take_failed_blocks() == {3}
    assert decode.stats["recv_failed"] == 1
    assert "handshakes=0" in repr(decode)


def sync(spec: RecvSpec) -> RecvSpec:
    spec.sync = True
    return spec


def test_sync_load_has_landed_when_it_returns(pair: Any) -> None:
    """The default load: the blocks hold prefill's bytes once load_now returns (the
    step's forward runs next), the first peer's handshake included; prefill's blocks
    are released, and nothing is reported to vLLM's async bookkeeping."""
    prefill, decode, pk, dk = pair
    local, remote = [9, 10, 11, 30], [3, 4, 5, 22]
    prefill.hold({"s": 30.0})
    decode.load_now([sync(spec(prefill, "s", local, remote))])
    for name in pk:
        for lb, rb in zip(local, remote, strict=True):
            assert torch.equal(block_of(dk[name], lb), block_of(pk[name], rb))
    assert decode.take_failed_blocks() == set() and decode.stats["recv_bytes"] > 0
    res = decode.results()
    assert not res.finished_recving and not res.failed_recving
    wait_results(prefill, "finished_sending", "s")
    # a second one on the known peer, several in one step
    prefill.hold({"s2": 30.0, "s3": 30.0})
    decode.load_now([sync(spec(prefill, "s2", [1], [2])), sync(spec(prefill, "s3", [5], [6]))])
    name = next(iter(pk))
    assert torch.equal(block_of(dk[name], 1), block_of(pk[name], 2))
    assert torch.equal(block_of(dk[name], 5), block_of(pk[name], 6))
    assert decode.stats["recv_requests"] == 3 and decode.stats["recv_failed"] == 0


def test_sync_load_failures_mark_their_blocks_within_the_timeout(pair: Any) -> None:
    """A silent peer, a refused endpoint, block ids past the end, an expired lease: each
    comes back as failed blocks (vLLM recomputes them) within timeout_s, the others in
    the same step still load, and no block is half-written by a late read."""
    prefill, decode, pk, dk = pair
    before = {name: t.clone() for name, t in dk.items()}
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        expired = sync(spec(prefill, "expired", [6], [6]))
        expired.lease_expiry = time.time() - 1
        prefill.hold({"live": 30.0})
        started = time.monotonic()
        decode.load_now([sync(RecvSpec("dead", [3], [1], dead, "x", "dead")),
                         sync(RecvSpec("gone", [4], [1], "tcp://127.0.0.1:9", "x", "gone")),
                         sync(spec(prefill, "far", [5], [NUM_BLOCKS + 1])),
                         expired, sync(spec(prefill, "live", [8], [7]))])
        elapsed = time.monotonic() - started
    assert elapsed < 2.0 + 1.5, elapsed  # timeout_s is 2 s
    assert decode.take_failed_blocks() == {3, 4, 5, 6}
    name = next(iter(pk))
    assert torch.equal(block_of(dk[name], 8), block_of(pk[name], 7))
    for name, tensor in dk.items():
        for b in (3, 4, 5, 6):
            assert torch.equal(block_of(tensor, b), block_of(before[name], b))
    assert decode.stats["recv_failed"] == 4
    res = decode.results()
    assert not res.finished_recving and not res.failed_recving


def forward(worker: TEConnectorWorker, names: list[str]) -> None:
    """What vLLM does around a step's forward: metadata bound, a wait per attention
    layer in ``names`` (in that order), then the end of the forward."""
    worker.start_step()
    for name in names:
        worker.wait_for_layer(name)
    worker.finish_layered()


def landed(pk: dict[str, Any], dk: dict[str, Any], name: str, local: list[int],
           remote: list[int]) -> bool:
    return all(torch.equal(block_of(dk[name], lb), block_of(pk[name], rb))
               for lb, rb in zip(local, remote, strict=True))


def test_layer_groups_double_after_the_first_two() -> None:
    names = [f"l{i}" for i in range(20)]
    groups = layer_groups(names)
    assert [len(g) for g in groups] == [1, 1, 2, 4, 8, 4]
    assert [n for g in groups for n in g] == names
    assert layer_groups([]) == [] and layer_groups(["a"]) == [["a"]]


def test_sync_load_goes_layer_by_layer_once_the_forward_waits_for_every_layer(
        pair: Any) -> None:
    """After a forward that waited for every layer, a sync load returns once the first
    layer (in the forward's order) and the last block of every layer have landed (the
    forward writes the new tokens' KV into that block before it waits for a layer);
    each later layer has landed when the forward's wait for it returns, and prefill is
    told its blocks were read only after the last one."""
    prefill, decode, pk, dk = pair
    order = list(reversed(list(dk)))  # the forward's order, not the dict's
    forward(decode, order[:-1])  # one layer not waited for: nothing learnt
    local, remote = [9, 10, 11, 30], [3, 4, 5, 22]
    prefill.hold({"whole": 30.0})
    decode.start_step()
    decode.load_now([sync(spec(prefill, "whole", local, remote))])
    assert all(landed(pk, dk, name, local, remote) for name in dk)
    decode.finish_layered()
    assert decode.stats["recv_layered"] == 0
    wait_results(prefill, "finished_sending", "whole")

    forward(decode, order)  # now learnt
    local, remote = [12, 13, 14, 40], [23, 24, 25, 41]
    prefill.hold({"lw": 30.0})
    decode.start_step()
    decode.load_now([sync(spec(prefill, "lw", local, remote))])
    assert decode.stats["recv_layered"] == 1
    assert landed(pk, dk, order[0], local, remote)
    assert all(landed(pk, dk, name, local[-1:], remote[-1:]) for name in dk)
    for name in order:
        decode.wait_for_layer(name)
        assert landed(pk, dk, name, local, remote)
    assert "lw" not in prefill.results().finished_sending
    decode.finish_layered()
    assert decode.take_failed_blocks() == set() and decode.stats["recv_failed"] == 0
    wait_results(prefill, "finished_sending", "lw")
    stats = decode.interval_stats()
    assert stats is not None and stats["layered_loads"] == 1
    assert len(stats["load_wait_seconds"]) == 2  # one per step with sync loads


def test_a_layer_by_layer_load_outside_the_lease_is_recomputed(pair: Any) -> None:
    """The later layers of a layer-wise load are checked as a whole load is: landed
    after the lease ran out (their bytes may be another request's), every block of the
    load goes back to vLLM as failed and prefill is not told they were read."""
    prefill, decode, _, dk = pair
    order = list(dk)
    forward(decode, order)
    prefill.hold({"late": 30.0})
    late = sync(spec(prefill, "late", [2, 3, 4], [5, 6, 7]))
    late.lease_expiry = time.time() + 0.3
    decode.start_step()
    decode.load_now([late])
    time.sleep(0.4)
    for name in order:
        decode.wait_for_layer(name)
    res = decode.results()  # ends the step as vLLM does after the forward
    assert decode.take_failed_blocks() == {2, 3, 4}
    assert decode.stats["recv_failed"] == 1 and decode.stats["recv_layered"] == 1
    assert not res.finished_recving and not res.failed_recving
    time.sleep(0.2)
    assert "late" not in prefill.results().finished_sending


def test_a_failed_later_layer_fails_the_load_without_a_late_write(pair: Any) -> None:
    """Prefill gone after the first layer landed: the later layers fail within the
    timeout, the load's blocks are reported failed, and nothing lands in them after."""
    prefill, decode, _, dk = pair
    order = list(dk)
    forward(decode, order)
    prefill.hold({"cut": 30.0})
    decode.start_step()
    # the first READ lands; the engine closes before the others are posted
    before_later_reads(decode, prefill.close)
    started = time.monotonic()
    decode.load_now([sync(spec(prefill, "cut", [2, 3, 4], [5, 6, 7]))])
    for name in order:
        decode.wait_for_layer(name)
    decode.results()
    assert time.monotonic() - started < 2.0 + 1.5  # timeout_s is 2 s
    assert decode.take_failed_blocks() == {2, 3, 4} and decode.stats["recv_failed"] == 1
    after = {name: t.clone() for name, t in dk.items()}
    time.sleep(0.2)
    assert all(torch.equal(after[name], dk[name]) for name in dk)


def test_interval_stats_count_each_event_once(pair: Any) -> None:
    """What vLLM's loggers and /metrics get: the change since the last step, summed
    across workers; nothing to report is None."""
    prefill, decode, _, _ = pair
    assert decode.interval_stats() is None and prefill.interval_stats() is None
    prefill.hold({"a": 30.0, "b": 30.0})
    decode.load_now([sync(spec(prefill, "a", [1, 2], [3, 4]))])
    decode.start_load([spec(prefill, "b", [5], [6])])
    wait_results(decode, "finished_recving", "b")
    decode.load_now([sync(spec(prefill, "c", [7], [NUM_BLOCKS + 9]))])  # fails
    deadline = time.monotonic() + 5
    while prefill.held and time.monotonic() < deadline:
        prefill.results()
        time.sleep(0.005)
    d, p = decode.interval_stats(), prefill.interval_stats()
    assert d is not None and p is not None
    assert (d["loads"], d["sync_loads"], d["load_failures"]) == (3, 2, 1)
    assert d["load_bytes"] == decode.stats["recv_bytes"] > 0
    assert len(d["load_seconds"]) == 2 and p["sent"] == 2 and len(p["held_seconds"]) == 2
    assert p["holds"] == 2
    assert decode.interval_stats() is None and prefill.interval_stats() is None
    total = TEConnectorStats(data=d).aggregate(TEConnectorStats(data=p))
    assert isinstance(total, TEConnectorStats) and not total.is_empty()
    summary = total.reduce()
    assert summary["loads"] == 3 and summary["sent"] == 2
    assert 0 < summary["load_ms_p50"] <= summary["load_ms_p99"]
    assert TEConnectorStats().is_empty() and TEConnectorStats().reduce() == {}
    # another version's keys are dropped, missing ones read as nothing
    assert TEConnectorStats(data={"loads": 1, "future": [1]}).reduce() == {"loads": 1}


def test_a_refused_endpoint_is_a_load_error_at_once(pair: Any) -> None:
    _, decode, _, _ = pair
    started = time.monotonic()
    decode.start_load([RecvSpec("gone", [3], [1], "tcp://127.0.0.1:9", "x", "gone")])
    res = wait_results(decode, "finished_recving", "gone")
    assert time.monotonic() - started < 1.5  # the handshake would run out at 2 s
    assert res.failed_recving == {"gone"} and decode.take_failed_blocks() == {3}


def test_close_while_a_handshake_is_under_way(clock: FakeClock) -> None:
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=30.0)
    worker = TEConnectorWorker("closing", cfg, COMPAT, clock)
    worker.register_kv_caches(gpu_caches(7), NUM_BLOCKS)
    worker.start_load([RecvSpec("r", [1], [1], "tcp://127.0.0.1:9", "x", "r")])
    started = time.monotonic()
    worker.close()  # the handshake fails with the engine; close does not wait 30 s
    assert time.monotonic() - started < 5.0
    worker.close()


def test_incompatible_peer_is_refused_with_a_clear_message(
        pair: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    prefill, _, _, _ = pair
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    other = TEConnectorWorker("d2", cfg, dict(COMPAT, block_size=32), clock)
    try:
        other.register_kv_caches(gpu_caches(5), NUM_BLOCKS)
        other.start_load([spec(prefill, "mismatch", [1], [1])])
        res = wait_results(other, "finished_recving", "mismatch")
        assert res.failed_recving == {"mismatch"}
        assert "incompatible KV caches" in caplog.text
        assert "block_size: ours=32 peer=16" in caplog.text
    finally:
        other.close()


def _manifest_case(decode: TEConnectorWorker, case: str) -> bytes:
    import msgpack

    from transfer_engine.layout import BlockLayout
    layers = {name: [f"kv/{name}", lay.to_wire()] for name, lay in decode.layouts.items()}
    if case == "garbage":
        return b"\xc1" * 64
    if case == "other-block-bytes":  # the right hash, blocks of another size
        lay = next(iter(decode.layouts.values()))
        wrong = BlockLayout(lay.num_blocks, lay.block_stride * 2, lay.block_bytes * 2,
                            (0, lay.num_blocks * lay.block_stride * 2))
        layers = {name: [f"kv/{name}", wrong.to_wire()] for name in layers}
    if case == "negative-blocks":
        layers = {name: [v[0], dict(v[1], num_blocks=-1)] for name, v in layers.items()}
    return bytes(msgpack.packb({"version": PROTOCOL_VERSION, "compat": decode.compat,
                                "hash": decode.hash, "layers": layers}))


@pytest.mark.parametrize(("case", "says"), [
    ("huge", "KV manifest of 5242880 bytes"),
    ("garbage", "malformed KV manifest"),
    ("other-block-bytes", "cannot take the peer's blocks: block_bytes"),
    ("negative-blocks", "malformed KV manifest"),
])
def test_a_hostile_manifest_is_a_load_error(pair: Any, case: str, says: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A peer that is not a vLLM worker (or lies about its KV) publishes a manifest
    that is huge, garbage or describes blocks ours cannot take: the load fails at once,
    with the reason in the log, and decode reads nothing else from it."""
    import numpy as np

    from transfer_engine import Engine
    _, decode, _, _ = pair
    with Engine("evil", transports=("tcp",)) as evil:
        body = np.zeros(5 << 20, dtype=np.uint8) if case == "huge" else \
            np.frombuffer(bytearray(_manifest_case(decode, case)), dtype=np.uint8)
        evil.register(body, name=MANIFEST_SEGMENT)
        for name, tensor in decode.layouts.items():  # segments the lies point at
            evil.register(np.zeros(tensor.extent + tensor.segment_offset, np.uint8),
                          name=f"kv/{name}")
        decode.start_load([RecvSpec("h", [1], [1], evil.endpoint, "evil", "h")])
        res = wait_results(decode, "finished_recving", "h")
        assert res.failed_recving == {"h"}
        assert says in caplog.text
        assert decode.engine is not None and decode.engine.stats["bytes_read"] < 6 << 20


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity")
                    or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engine_threads_are_not_pinned_to_the_compute_core(pair: Any, clock: FakeClock
                                                           ) -> None:
    # vLLM's CPU worker pins its main thread, which creates the connector, to one core;
    # a thread inherits its creator's CPUs
    prefill, _, _, _ = pair
    everywhere = os.sched_getaffinity(0)
    before = {t.ident for t in threading.enumerate()}
    os.sched_setaffinity(0, {min(everywhere)})
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    worker = TEConnectorWorker("pinned", cfg, COMPAT, clock)
    try:
        worker.register_kv_caches(gpu_caches(8), NUM_BLOCKS)
        prefill.hold({"p": 30.0})
        worker.start_load([spec(prefill, "p", [1], [2])])
        assert os.sched_getaffinity(0) == {min(everywhere)}  # the caller's own CPUs stay
        wait_results(worker, "finished_recving", "p")
        started = [t for t in threading.enumerate()
                   if t.ident not in before and t.name.startswith("te-")]
        assert {t.name.split("-")[1] for t in started} >= {"control", "tcp", "vllm"}
        for thread in started:
            assert thread.native_id is not None
            assert os.sched_getaffinity(thread.native_id) == everywhere, thread.name
    finally:
        os.sched_setaffinity(0, everywhere)
        worker.close()


def test_no_leaked_blocks_after_many_requests(pair: Any) -> None:
    prefill, decode, _, _ = pair
    received: set[str] = set()
    sent: set[str] = set()
    for i in range(0, 200, 4):
        batch = {f"r{j}": [j % NUM_BLOCKS] for j in range(i, i + 4)}
        prefill.hold({rid: 30.0 for rid in batch})
        decode.start_load([spec(prefill, rid, [(NUM_BLOCKS - 1 - b[0]) % NUM_BLOCKS], b)
                           for rid, b in batch.items()])
        deadline = time.monotonic() + 5
        while not set(batch) <= received and time.monotonic() < deadline:
            res = decode.results()
            assert not res.failed_recving
            received |= res.finished_recving
            sent |= prefill.results().finished_sending
    deadline = time.monotonic() + 5
    while prefill.held and time.monotonic() < deadline:
        sent |= prefill.results().finished_sending
        time.sleep(0.005)
    assert len(received) == len(sent) == 200
    assert prefill.held == 0 and prefill.stats["sent_requests"] == 200
    assert decode.stats["recv_failed"] == 0 and decode.stats["recv_requests"] == 200
    assert decode.receiving == 0 and early_sent_notes(prefill) == set()
    assert decode.engine is not None and decode.engine.stats["transfers_failed"] == 0
