"""Traffic policy decisions under a fake clock: breaker states, the ejection cap, path
preference, and the RDMA/TCP share following measured latency and success."""

from __future__ import annotations

import pytest

from scheduler.clock import FakeClock
from scheduler.policy import (
    BreakerBoard,
    BreakerState,
    CircuitBreaker,
    PathClass,
    TrafficPolicy,
    path_class,
)


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = FakeClock()
    b = CircuitBreaker(threshold=3, base_cooldown=1.0, max_cooldown=60.0, clock=clock)
    b.record(False)
    b.record(False)
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record(False)
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.advance(0.99)
    assert b.state is BreakerState.OPEN
    clock.advance(0.01)
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    b.record(True)
    assert b.state is BreakerState.CLOSED and b.allow() and b.failures == 0


def test_breaker_cooldown_doubles_then_resets_after_a_healthy_spell() -> None:
    clock = FakeClock()
    b = CircuitBreaker(threshold=1, base_cooldown=1.0, max_cooldown=8.0, clock=clock)
    cooldowns = []
    for _ in range(5):
        b.record(False)  # opens (closed) or reopens (half-open probe failed)
        assert b.state is BreakerState.OPEN
        cooldowns.append(b.open_until - clock())
        clock.advance(cooldowns[-1])
        assert b.state is BreakerState.HALF_OPEN and b.allow()
    assert cooldowns == [1.0, 2.0, 4.0, 8.0, 8.0]
    b.record(True)
    clock.advance(8.0)  # healthy for max_cooldown: the next opening starts over
    b.record(False)
    assert b.open_until - clock() == 1.0


def test_a_lost_probe_does_not_hold_the_node_out() -> None:
    clock = FakeClock()
    b = CircuitBreaker(threshold=1, base_cooldown=1.0, clock=clock)
    b.record(False)
    clock.advance(1.0)
    assert b.allow() and not b.allow()
    clock.advance(1.0)  # the probe never answered
    assert b.allow()


def test_failures_while_open_are_ignored() -> None:
    clock = FakeClock()
    b = CircuitBreaker(threshold=1, base_cooldown=1.0, clock=clock)
    b.record(False)
    until = b.open_until
    b.record(False)
    assert b.open_until == until and b.strikes == 1


def test_ejection_cap_holds_per_pool() -> None:
    clock = FakeClock()
    changes: list[tuple[str, BreakerState]] = []
    board = BreakerBoard(threshold=1, base_cooldown=5.0, max_eject_fraction=0.5,
                         clock=clock, on_change=lambda n, s: changes.append((n, s)))
    for i in range(4):
        board.add(f"p{i}", "prefill")
    board.add("d0", "decode")
    assert board.cap("prefill") == 2 and board.cap("decode") == 0
    for i in range(4):
        board.record(f"p{i}", False)
    assert board.ejected("prefill") == ["p0", "p1"]
    assert board.state("p2") is BreakerState.CLOSED and board.allow("p3")
    assert board.capped == 2
    board.record("d0", False)  # a pool of one never loses its only node
    assert board.allow("d0") and board.ejected("decode") == []
    clock.advance(5.0)
    board.poll()
    assert ("p0", BreakerState.HALF_OPEN) in changes
    board.record("p0", True)  # the probe succeeded: room under the cap again
    assert board.ejected("prefill") == ["p1"]
    board.record("p2", False)
    assert board.ejected("prefill") == ["p1", "p2"]
    assert changes[:2] == [("p0", BreakerState.OPEN), ("p1", BreakerState.OPEN)]


def test_removed_nodes_free_the_cap() -> None:
    board = BreakerBoard(threshold=1, max_eject_fraction=0.5, clock=FakeClock())
    for i in range(2):
        board.add(f"p{i}", "prefill")
    board.record("p0", False)
    board.remove("p0")
    board.add("p2", "prefill")
    board.record("p1", False)
    assert board.ejected("prefill") == ["p1"]


def test_path_class_prefers_host_pod_zone() -> None:
    me = {"host": "h1", "pod": "a", "zone": "z1"}
    assert path_class(me, {"host": "h1", "pod": "b"}) is PathClass.HOST
    assert path_class(me, {"host": "h2", "pod": "a", "zone": "z1"}) is PathClass.POD
    assert path_class(me, {"host": "h2", "pod": "b", "zone": "z1"}) is PathClass.ZONE
    assert path_class(me, {"host": "h2", "pod": "b", "zone": "z2"}) is PathClass.CROSS_ZONE
    assert path_class({}, {}) is PathClass.ZONE  # unlabelled: one zone


def test_order_follows_the_path() -> None:
    policy = TrafficPolicy(clock=FakeClock())
    me = {"host": "h1", "pod": "a", "zone": "z1"}
    both = ["tcp", "rdma", "shm", "other"]
    assert policy.order(both, me, {"name": "x", "host": "h1"})[:1] == ["shm"]
    assert policy.order(both, me, {"name": "y", "host": "h2", "pod": "a", "zone": "z1"}
                        ) == ["rdma", "tcp", "shm", "other"]
    assert policy.order(both, me, {"name": "z", "host": "h3", "pod": "b", "zone": "z2"}
                        )[:2] == ["tcp", "rdma"]
    assert policy.order(["tcp"], me, {"name": "w", "zone": "z1"}) == ["tcp"]


def _feed(policy: TrafficPolicy, peer: str, rdma_s: float, tcp_s: float, n: int,
          rdma_ok: bool = True) -> None:
    for _ in range(n):
        policy.record(peer, "rdma", rdma_s, rdma_ok, nbytes=1 << 20)
        policy.record(peer, "tcp", tcp_s, True, nbytes=1 << 20)


def test_share_shifts_with_injected_latency() -> None:
    policy = TrafficPolicy(clock=FakeClock(), floor=0.05)
    assert policy.share("d0") == 0.95  # unmeasured: prefer RDMA
    _feed(policy, "d0", rdma_s=0.001, tcp_s=0.010, n=20)
    assert policy.share("d0") == 0.95
    _feed(policy, "d0", rdma_s=0.050, tcp_s=0.010, n=30)  # RDMA got 50x slower
    assert policy.share("d0") == 0.05
    _feed(policy, "d0", rdma_s=0.011, tcp_s=0.010, n=40)  # nearly equal: near even
    assert 0.3 < policy.share("d0") < 0.5
    picks = [policy.pick("d0", ["rdma", "tcp"]) for _ in range(100)]
    assert abs(picks.count("rdma") - 100 * policy.share("d0")) <= 1


def test_share_shifts_with_failures() -> None:
    policy = TrafficPolicy(clock=FakeClock(), floor=0.02,
                           breakers=BreakerBoard(threshold=100, clock=FakeClock()))
    _feed(policy, "d1", rdma_s=0.001, tcp_s=0.010, n=10)
    before = policy.share("d1")
    _feed(policy, "d1", rdma_s=0.001, tcp_s=0.010, n=10, rdma_ok=False)
    assert policy.stats("d1", "rdma").success < 0.2
    assert policy.share("d1") < before and policy.share("d1") == 0.02
    # Failures before any success: judged on success alone.
    fresh = TrafficPolicy(clock=FakeClock(), floor=0.02)
    for _ in range(5):
        fresh.record("d2", "rdma", 1.0, False)
    assert fresh.share("d2") < 0.5


def test_policy_validates_its_settings() -> None:
    with pytest.raises(ValueError):
        TrafficPolicy(alpha=0)
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)
    with pytest.raises(ValueError):
        BreakerBoard(max_eject_fraction=1.5)
