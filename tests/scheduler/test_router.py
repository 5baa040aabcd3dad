"""Routing decisions on small fleets: prefix affinity, hot-spot avoidance, decode
locality, prefill on decode for short prompts, the baseline policies, breakers."""

from __future__ import annotations

import pytest

from scheduler.clock import FakeClock
from scheduler.cost import CostModel
from scheduler.errors import NoInstanceError, UnknownPolicyError
from scheduler.fleet import Fleet
from scheduler.policy import BreakerBoard, PathClass, TrafficPolicy
from scheduler.router import Request, Router


def _fleet(clock: FakeClock | None = None) -> Fleet:
    """Two pods in one zone and one in another: p0,p1,d0 | p2,d1 | p3,d2 (zone z2)."""
    clock = clock or FakeClock()
    traffic = TrafficPolicy(clock=clock, breakers=BreakerBoard(threshold=1, clock=clock))
    fleet = Fleet(traffic=traffic, kv_tokens=100_000)
    for name, role, pod, zone in [("p0", "prefill", "a", "z1"), ("p1", "prefill", "a", "z1"),
                                  ("d0", "decode", "a", "z1"), ("p2", "prefill", "b", "z1"),
                                  ("d1", "decode", "b", "z1"), ("p3", "prefill", "c", "z2"),
                                  ("d2", "decode", "c", "z2")]:
        fleet.add(name, role, host=name, pod=pod, zone=zone)
    return fleet


def _req(keys: list[int], tokens: int | None = None, out: int = 10) -> Request:
    return Request(keys, tokens if tokens is not None else 512 * len(keys), out)


def test_cache_aware_goes_to_the_longest_prefix_and_the_nearest_decode() -> None:
    fleet = _fleet()
    fleet.prefix.insert(fleet.prefill.slot["p2"], list(range(8)))
    router = Router(fleet, "default")
    d = router.route(_req(list(range(10))), now=0.0)
    assert d.prefill_name == "p2" and d.cached_blocks == 8
    assert d.decode_name == "d1" and d.path is PathClass.POD  # same pod as p2
    assert d.uncached_tokens == 1024 and d.est_ttft_s > d.prefill_s > 0


def test_hot_prefix_spills_when_its_holder_is_busy() -> None:
    fleet = _fleet()
    keys = list(range(4))
    p0 = fleet.prefill.slot["p0"]
    fleet.prefix.insert(p0, keys)
    fleet.prefill.free_at[p0] = 60.0  # a minute of queued work
    d = Router(fleet, "default").route(_req(keys + [99]), now=0.0)
    assert d.prefill_name != "p0" and d.cached_blocks == 0


def test_decode_avoids_full_and_slow_instances() -> None:
    fleet = _fleet()
    fleet.prefix.insert(fleet.prefill.slot["p2"], list(range(8)))
    fleet.decode.kv_used[fleet.decode.slot["d1"]] = 99_000  # d1 (same pod) is full
    d = Router(fleet, "default").route(_req(list(range(10))), now=0.0)
    assert d.prefill_name == "p2" and d.decode_name == "d0" and d.path is PathClass.ZONE


def test_short_prompts_prefill_on_decode() -> None:
    fleet = _fleet()
    router = Router(fleet, "default", local_prefill_tokens=512)
    d = router.route(_req([], tokens=300), now=0.0)
    assert d.local and d.prefill is None and d.transport == "local"
    assert fleet.decode.queue[d.decode] == 1
    assert not router.route(_req([1, 2], tokens=1024), now=0.0).local
    assert not Router(_fleet(), "least_loaded").route(_req([], 300), now=0.0).local


def test_round_robin_and_least_loaded() -> None:
    fleet = _fleet()
    rr = Router(fleet, "round_robin")
    names = [rr.route(_req([i]), now=0.0).prefill_name for i in range(8)]
    assert names == ["p0", "p1", "p2", "p3"] * 2
    fleet = _fleet()
    fleet.prefill.queue[:4] = [3, 1, 0, 2]
    fleet.decode.kv_used[:3] = [50, 10, 90]
    d = Router(fleet, "least_loaded").route(_req([1]), now=0.0)
    assert (d.prefill_name, d.decode_name) == ("p2", "d1")


def test_prefix_only_ignores_load() -> None:
    fleet = _fleet()
    p3 = fleet.prefill.slot["p3"]
    fleet.prefix.insert(p3, [1, 2])
    fleet.prefill.free_at[p3] = 1e6
    assert Router(fleet, "prefix_only").route(_req([1, 2, 3]), now=0.0).prefill_name == "p3"


def test_excluded_and_ejected_instances_are_skipped() -> None:
    clock = FakeClock()
    fleet = _fleet(clock)
    fleet.prefix.insert(fleet.prefill.slot["p0"], [1, 2, 3])
    router = Router(fleet, "default")
    assert router.route(_req([1, 2, 3]), now=0.0, exclude={"p0"}).prefill_name != "p0"
    fleet.traffic.breakers.record("p0", False)  # threshold 1: ejected
    assert fleet.prefill.ejected[fleet.prefill.slot["p0"]]
    assert router.route(_req([1, 2, 3]), now=0.0).prefill_name != "p0"
    clock.advance(1.0)  # half-open: one probe goes to it, the next request elsewhere
    assert router.route(_req([1, 2, 3]), now=1.0).prefill_name == "p0"
    assert router.route(_req([1, 2, 3]), now=1.0).prefill_name != "p0"
    fleet.traffic.breakers.record("p0", True)
    assert router.route(_req([1, 2, 3]), now=1.0).prefill_name == "p0"


def test_no_instance_and_unknown_policy() -> None:
    fleet = Fleet()
    fleet.add("p0", "prefill")
    with pytest.raises(NoInstanceError) as err:
        Router(fleet).route(_req([1]), now=0.0)
    assert err.value.role == "decode"
    with pytest.raises(UnknownPolicyError):
        Router(fleet, "fastest")


def test_store_hits_count_and_cost_a_fetch() -> None:
    cost = CostModel()
    fleet = _fleet()
    fleet.store_prefix = lambda keys: 6
    d = Router(fleet, "default", cost=cost).route(_req(list(range(8))), now=0.0)
    assert d.cached_blocks == 0 and d.store_blocks == 6
    assert d.prefill_s > cost.fetch_s(6) > 0


def test_a_request_late_everywhere_takes_the_least_work() -> None:
    """Every queue is past the request's TTFT target: its own TTFT is lost anyway, so it
    goes where it costs the least compute (its prefix holder), not to the earliest."""
    fleet = _fleet()
    keys = list(range(8))
    pre = fleet.prefill
    fleet.prefix.insert(pre.slot["p0"], keys)
    for name in ("p1", "p2", "p3"):
        pre.free_at[pre.slot[name]] = 20.0
    pre.free_at[pre.slot["p0"]] = 30.0
    d = Router(fleet, "default").route(_req(keys + [98, 99]), now=0.0)
    assert d.prefill_name == "p0" and d.cached_blocks == 8
    assert d.est_ttft_s > 30.0


def _busy_holder(holder_free_at: float = 1.65, others_free_at: float = 0.6,
                 capacity: int | None = None) -> tuple[Fleet, list[int]]:
    """p0 holds 8 blocks of the request and is busy until ``holder_free_at``; the other
    prefill instances are free from ``others_free_at`` (their caches filled with other
    blocks up to ``capacity``, when given)."""
    fleet = _fleet()
    if capacity is not None:
        fleet.prefix.capacity = capacity
    keys = list(range(8))
    pre = fleet.prefill
    fleet.prefix.insert(pre.slot["p0"], keys)
    pre.free_at[pre.slot["p0"]] = holder_free_at
    for name in ("p1", "p2", "p3"):
        pre.free_at[pre.slot[name]] = others_free_at
        if capacity is not None:
            fleet.prefix.insert(pre.slot[name], [1000 + 100 * pre.slot[name] + i
                                                 for i in range(capacity)])
    return fleet, keys


def test_a_request_that_can_still_make_it_takes_the_earliest() -> None:
    """No queue leaves the margin, but some still meet the target: the earliest estimate
    wins, even against the holder's smaller work (without reads from the holder's cache,
    which the next tests cover)."""
    # p0: + 0.14 s of prefill, just within 1.83 s; the others: + 0.98 s (full prefill
    # and the blocks left behind)
    fleet, keys = _busy_holder(1.65, 0.6)
    d = Router(fleet, "default", peer_fetch=False).route(_req(keys + [98, 99]), now=0.0)
    assert d.prefill_name in ("p1", "p2", "p3") and d.cached_blocks == 0
    fleet, keys = _busy_holder(1.65, 1.0)  # the others: past the target
    d = Router(fleet, "default", peer_fetch=False).route(_req(keys + [98, 99]), now=0.0)
    assert d.prefill_name == "p0" and d.cached_blocks == 8


def test_a_busy_holder_lends_its_cached_blocks_instead_of_its_compute() -> None:
    """The holder's queue is past the margin: another instance reads the 8 cached blocks
    from it (one-sided, over their pod's link) and computes only the rest, where
    computing them would have cost 8 x 51 ms."""
    fleet, keys = _busy_holder()
    d = Router(fleet, "default").route(_req(keys + [98, 99]), now=0.0)
    assert d.prefill_name == "p1"  # the holder's pod: the fastest read
    assert d.cached_blocks == 0 and d.store_blocks == 8
    assert d.uncached_tokens == 2 * 512
    assert d.prefill_s < 0.2  # two blocks computed plus a 0.5 GB read at 50 GB/s
    assert fleet.prefix.overlaps(keys)[fleet.prefill.slot["p1"]] == 8  # it holds them now


def test_a_holder_with_room_keeps_its_requests() -> None:
    """The holder meets the target with the margin to spare: nothing is copied, it
    takes the request (a copy would cost the reader's cache space for nothing)."""
    fleet, keys = _busy_holder(0.0, 0.0)
    d = Router(fleet, "default").route(_req(keys + [98, 99]), now=0.0)
    assert d.prefill_name == "p0" and d.cached_blocks == 8 and d.store_blocks == 0


def test_no_read_from_a_holder_when_computing_is_faster_or_caches_are_full() -> None:
    """Over slow links the read loses to computing; and a reader whose cache is full
    would evict as much as it copies: computing wins there too."""
    slow = CostModel(tcp_bytes_per_s=1e8, rdma_bytes_per_s=1e8, pod_bytes_per_s=1e8)
    fleet, keys = _busy_holder()
    d = Router(fleet, "default", cost=slow).route(_req(keys + [98, 99]), now=0.0)
    assert d.store_blocks == 0
    fleet, keys = _busy_holder(capacity=16)
    d = Router(fleet, "default").route(_req(keys + [98, 99]), now=0.0)
    assert d.store_blocks == 0
