"""Immediate counting: a notification fires exactly once, whatever the arrival order."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from transfer_engine.notify import ImmediateCounter, Notification

Arrival = tuple[str, int, int, bytes | None]  # peer, transfer id, expected, payload


def transfer(peer: str, tid: int, expected: int, payload: bytes, carrier: int
             ) -> list[Arrival]:
    """The immediates of one transfer; the ``carrier``-th holds the payload."""
    return [(peer, tid, expected, payload if i == carrier else None)
            for i in range(expected)]


def feed(counter: ImmediateCounter, arrivals: list[Arrival]
         ) -> list[tuple[int, Notification]]:
    out = []
    for i, (peer, tid, expected, payload) in enumerate(arrivals):
        note = counter.arrive(peer, tid, expected, payload)
        if note is not None:
            out.append((i, note))
    return out


def check_fired(arrivals: list[Arrival], fired: list[tuple[int, Notification]],
                payloads: dict[tuple[str, int], bytes]) -> None:
    """Each transfer fired once, at its last immediate, with its payload."""
    last = {(a[0], a[1]): i for i, a in enumerate(arrivals)}
    assert sorted((n.peer, n.transfer_id) for _, n in fired) == sorted(payloads)
    for i, note in fired:
        key = (note.peer, note.transfer_id)
        assert i == last[key]
        assert note.payload == payloads[key]


def test_single_immediate_fires_at_once_and_stores_nothing() -> None:
    counter = ImmediateCounter()
    assert counter.arrive("p", 1, 1, b"hi") == Notification("p", 1, b"hi")
    assert counter.arrive("p", 2, 1) == Notification("p", 2, b"")
    assert len(counter) == 0


@pytest.mark.parametrize("expected", [2, 3, 4, 5])
def test_every_order_and_payload_position_fires_once(expected: int) -> None:
    for carrier in range(expected):
        counter = ImmediateCounter()
        arrivals = transfer("p", 7, expected, b"note", carrier)
        fired = feed(counter, arrivals)
        assert [i for i, _ in fired] == [expected - 1]
        assert fired[0][1] == Notification("p", 7, b"note")
        assert len(counter) == 0


def test_all_interleavings_of_small_transfers_from_two_peers() -> None:
    # 2 + 2 + 3 immediates; the same transfer id from two peers is two transfers
    base = (transfer("a", 1, 2, b"a1", 0) + transfer("b", 1, 2, b"b1", 1)
            + transfer("a", 2, 3, b"a2", 2))
    payloads = {("a", 1): b"a1", ("b", 1): b"b1", ("a", 2): b"a2"}
    seen = set()
    for order in itertools.permutations(range(len(base))):
        arrivals = [base[i] for i in order]
        key = tuple(arrivals)
        if key in seen:
            continue
        seen.add(key)
        counter = ImmediateCounter()
        check_fired(arrivals, feed(counter, arrivals), payloads)
        assert len(counter) == 0 and counter.dropped == 0
    assert len(seen) == 5040 // 2  # two immediates of ("a", 2) look the same


def test_random_interleavings_of_many_transfers_from_several_peers() -> None:
    rng = random.Random(9)
    for _ in range(50):
        arrivals: list[Arrival] = []
        payloads: dict[tuple[str, int], bytes] = {}
        for peer in ("p0", "p1", "p2", "p3"):
            for tid in rng.sample(range(1000), 40):
                expected = rng.randint(1, 8)
                payload = rng.randbytes(rng.randint(0, 16))
                payloads[(peer, tid)] = payload
                arrivals += transfer(peer, tid, expected, payload, rng.randrange(expected))
        rng.shuffle(arrivals)
        counter = ImmediateCounter()
        check_fired(arrivals, feed(counter, arrivals), payloads)
        assert len(counter) == 0


def test_transfer_id_can_be_reused_after_it_fired() -> None:
    counter = ImmediateCounter()
    assert feed(counter, transfer("p", 3, 2, b"one", 0))[0][1].payload == b"one"
    assert feed(counter, transfer("p", 3, 3, b"two", 1))[0][1].payload == b"two"


def test_expected_mismatch_and_bad_expected_raise() -> None:
    counter = ImmediateCounter()
    assert counter.arrive("p", 1, 3) is None
    with pytest.raises(ValueError, match="expected 3 immediates, a later one says 2"):
        counter.arrive("p", 1, 2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="expected must be >= 1"):
            counter.arrive("p", 2, bad)
    # the bad immediates were not counted
    assert counter.arrive("p", 1, 3) is None
    assert counter.arrive("p", 1, 3) == Notification("p", 1, b"")


def test_max_pending_evicts_the_oldest_partial_transfer() -> None:
    counter = ImmediateCounter(max_pending=3)
    for tid in range(3):
        assert counter.arrive("p", tid, 2) is None
    assert counter.arrive("q", 9, 2) is None  # evicts ("p", 0)
    assert len(counter) == 3 and counter.dropped == 1
    # the evicted transfer starts over: its second immediate no longer completes it
    assert counter.arrive("p", 0, 2) is None  # evicts ("p", 1)
    assert counter.dropped == 2
    assert counter.arrive("p", 2, 2) == Notification("p", 2, b"")
    assert counter.arrive("q", 9, 2) == Notification("q", 9, b"")
    assert counter.arrive("p", 0, 2) == Notification("p", 0, b"")
    assert len(counter) == 0
    # completions need no room
    full = ImmediateCounter(max_pending=1)
    assert full.arrive("p", 1, 2) is None
    assert full.arrive("p", 5, 1) is not None and full.dropped == 0


def test_many_abandoned_transfers_stay_bounded() -> None:
    counter = ImmediateCounter(max_pending=100)
    for tid in range(5000):
        counter.arrive("dying", tid, 4)
    assert len(counter) == 100 and counter.dropped == 4900


def test_forget_peer_drops_only_that_peers_partial_transfers() -> None:
    counter = ImmediateCounter()
    for tid in range(3):
        counter.arrive("gone", tid, 2, b"x")
    counter.arrive("stays", 0, 2, b"s")
    assert counter.forget_peer("gone") == 3
    assert counter.forget_peer("gone") == 0
    assert counter.forget_peer("never") == 0
    assert len(counter) == 1
    assert counter.arrive("stays", 0, 2) == Notification("stays", 0, b"s")
    # a forgotten transfer starts over if the peer comes back
    assert counter.arrive("gone", 0, 2) is None


@pytest.mark.parametrize("bound", [0, -1])
def test_max_pending_below_one_is_refused(bound: int) -> None:
    with pytest.raises(ValueError, match="max_pending must be >= 1"):
        ImmediateCounter(max_pending=bound)


def test_a_flood_from_one_peer_never_evicts_another_peers_notification() -> None:
    counter = ImmediateCounter(max_per_peer=4096)
    assert counter.arrive("good", 1, 2, b"req-1") is None  # one rail of two landed
    for tid in range(70_000):
        assert counter.arrive("evil", tid, 2, b"junk") is None
    assert counter.pending("evil") == 4096 and counter.dropped == 70_000 - 4096
    assert counter.arrive("good", 1, 2) == Notification("good", 1, b"req-1")
    assert counter.arrive("good", 1, 2) is None  # exactly once: a repeat starts over


def test_the_global_bound_evicts_from_the_peer_holding_the_most() -> None:
    counter = ImmediateCounter(max_pending=10, max_per_peer=8)
    counter.arrive("good", 1, 2)
    for name in ("evil-a", "evil-b"):
        for tid in range(100):
            counter.arrive(name, tid, 2)
    assert len(counter) == 10 and counter.pending("good") == 1
    assert counter.arrive("good", 1, 2) == Notification("good", 1, b"")


def test_payload_bytes_are_bounded_per_peer_and_in_all() -> None:
    counter = ImmediateCounter(max_bytes=1 << 20, max_peer_bytes=256 << 10)
    counter.arrive("good", 1, 3, b"g" * 1000)
    for tid in range(100):
        counter.arrive("evil", tid, 2, b"x" * (64 << 10))
    assert counter.pending("evil") == 4  # 4 x 64 KiB fit its share
    for i in range(8):
        for tid in range(20):
            counter.arrive(f"evil-{i}", tid, 2, b"x" * (64 << 10))
    assert counter.pending_bytes <= 1 << 20 and counter.pending("good") == 1
    assert counter.arrive("good", 1, 3) is None
    assert counter.arrive("good", 1, 3) == Notification("good", 1, b"g" * 1000)


@pytest.mark.parametrize("field", ["max_per_peer", "max_bytes", "max_peer_bytes"])
def test_other_bounds_below_one_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        ImmediateCounter(**{field: 0})


def test_a_work_resent_after_it_landed_is_counted_once() -> None:
    """A NIC rail breaks after a work landed but before its answer: the initiator sends
    the work again over another rail, marked resent. Counting it twice would fire the
    notification before the other rail's bytes are in (or fire it twice)."""
    c = ImmediateCounter()
    assert c.arrive("p", 7, 2, b"note", b"t1", work=11) is None  # rail A's last work
    assert c.arrive("p", 7, 2, b"note", b"t1", work=11, resent=True) is None  # on B
    assert c.duplicates == 1 and c.pending("p") == 1
    note = c.arrive("p", 7, 2, None, b"t1", work=12)  # rail B's own last work
    assert note == Notification("p", 7, b"note")
    assert c.arrive("p", 7, 2, None, b"t1", work=12, resent=True) is None  # late copy
    # one rail: fires at once, and its resent copy does not fire again
    assert c.arrive("p", 8, 1, b"one", b"t1", work=13) == Notification("p", 8, b"one")
    assert c.arrive("p", 8, 1, b"one", b"t1", work=13, resent=True) is None
    # the same work id on another connection (a restarted peer) is another work
    assert c.arrive("p", 8, 1, b"one", b"t2", work=13, resent=True) == \
        Notification("p", 8, b"one")
    # a resent work whose first arrival never came (it broke before landing) counts
    assert c.arrive("p", 9, 1, b"n", b"t1", work=14, resent=True) == \
        Notification("p", 9, b"n")
    assert c.duplicates == 3


def test_work_ids_need_only_be_unique_per_rail() -> None:
    """A client that numbers its works per rail (the wire asks no more) sends the same
    work id on two rails of one connection: both count, nothing is dropped."""
    c = ImmediateCounter()
    assert c.arrive("p", 5, 2, b"real", b"t", work=5) is None
    assert c.arrive("p", 5, 2, None, b"t", work=5) == Notification("p", 5, b"real")
    assert c.arrive("p", 6, 1, None, b"t") is not None  # and none named at all
    assert c.duplicates == 0


def test_remembered_works_are_bounded() -> None:
    c = ImmediateCounter(max_recent=100)
    for work in range(1000):
        c.arrive("p", work, 1, None, b"t", work=work)
    assert c.recent_works == 100
    assert c.arrive("p", 999, 1, None, b"t", work=999, resent=True) is None  # a copy
    assert c.arrive("p", 0, 1, None, b"t", work=0, resent=True) is not None  # long gone
    with pytest.raises(ValueError, match="max_recent"):
        ImmediateCounter(max_recent=0)


def test_a_refused_immediate_is_not_remembered() -> None:
    c = ImmediateCounter()
    c.arrive("p", 5, 3, None, b"t", work=1)
    with pytest.raises(ValueError, match="expected 3"):
        c.arrive("p", 5, 2, None, b"t", work=2)
    c.arrive("p", 5, 3, None, b"t", work=2, resent=True)  # never counted: counts now
    assert c.arrive("p", 5, 3, b"x", b"t", work=3) == Notification("p", 5, b"x")


@pytest.mark.parametrize("bounds", [{"max_per_peer": 1}, {"max_pending": 3}])
def test_evicting_a_peers_only_entry_keeps_the_new_one(bounds: dict[str, int]) -> None:
    """The entry evicted to make room can be the arriving peer's only one: the new
    entry still counts, fires, and the count of entries stays true."""
    c = ImmediateCounter(**bounds)
    c.arrive("a", 1, 2)
    for peer in ("b", "c") if "max_pending" in bounds else ():
        c.arrive(peer, 1, 2)  # then every peer holds one: the first, a, is the fullest
    assert c.arrive("a", 2, 2, b"x") is None  # evicts a's transfer 1
    assert c.pending("a") == 1 and len(c) == sum(c.pending(p) for p in "abc")
    assert c.arrive("a", 2, 2) == Notification("a", 2, b"x")
    assert c.pending("a") == 0 and c.pending_bytes == 0


def test_the_attempts_of_one_transfer_notify_once_in_either_order() -> None:
    """A transfer whose answer was lost after its bytes landed is made again as a new
    attempt (a new transfer id, so the counts never mix) naming its first: the target
    notifies once, whichever attempt completes first, and with the first's id."""
    c = ImmediateCounter()
    # the first attempt completes, then the later one (same connection)
    assert c.arrive("p", 10, 2, b"n", b"t") is None
    assert c.arrive("p", 10, 2, None, b"t") == Notification("p", 10, b"n")
    assert c.arrive("p", 11, 1, b"n", b"t", first=10) is None
    assert c.arrive("p", 12, 2, b"n", b"t", first=10) is None  # a third: counted, dropped
    assert c.arrive("p", 12, 2, None, b"t", first=10) is None
    assert c.duplicates == 2 and len(c) == 0
    # the later attempt completes first; the first attempt's last immediate comes after
    assert c.arrive("p", 20, 2, None, b"t") is None
    assert c.arrive("p", 21, 1, b"m", b"t", first=20) == Notification("p", 20, b"m")
    assert c.arrive("p", 20, 2, b"m", b"t") is None
    assert c.duplicates == 3
    # a first attempt that never completed: the later one notifies, once
    assert c.arrive("p", 31, 2, b"k", b"t", first=30) is None
    assert c.arrive("p", 31, 2, None, b"t", first=30) == Notification("p", 30, b"k")
    assert c.arrive("p", 32, 1, b"k", b"t", first=30) is None
    # another connection (a restarted peer, an impostor) is another transfer
    assert c.arrive("p", 11, 1, b"n", b"u", first=10) == Notification("p", 10, b"n")
    assert c.arrive("q", 11, 1, b"n", b"t", first=10) == Notification("q", 10, b"n")


def test_a_peer_that_never_names_a_first_attempt_is_never_dropped() -> None:
    """Transfer ids are the initiator's: one that reuses them (a client of its own)
    gets every notification, as before."""
    c = ImmediateCounter()
    for _ in range(3):
        assert c.arrive("p", 5, 1, b"x", b"t") == Notification("p", 5, b"x")
    assert c.duplicates == 0


def test_remembered_notifications_are_bounded() -> None:
    c = ImmediateCounter(max_fired=10)
    for tid in range(1, 101):
        c.arrive("p", tid, 1, None, b"t")
    assert len(c._fired) == 10
    assert c.arrive("p", 200, 1, None, b"t", first=100) is None  # still remembered
    assert c.arrive("p", 201, 1, None, b"t", first=1) is not None  # long gone
    with pytest.raises(ValueError, match="max_fired"):
        ImmediateCounter(max_fired=0)


def test_an_engines_kept_notifications_are_bounded(make_engine, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
                                                   ) -> None:
    """Notifications are kept for Engine.notifications() even when callbacks take them;
    nobody reading them must not grow the process: the oldest go, counted."""
    import numpy as np  # noqa: PLC0415

    from transfer_engine import Descriptor  # noqa: PLC0415
    from transfer_engine import engine as engine_module  # noqa: PLC0415

    monkeypatch.setattr(engine_module, "KEPT_NOTES", 8)
    monkeypatch.setattr(engine_module, "KEPT_NOTE_BYTES", 10_000)
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    seen: list[Notification] = []
    b.on_notify(seen.append)
    b.register(np.zeros(4096, np.uint8), name="dst")
    src = a.register(np.ones(4096, np.uint8))
    peer = a.connect(b.endpoint)
    for i in range(12):  # 12 small notes: the count bound
        a.write(peer, [(Descriptor(src, 0, 64), Descriptor(peer.segment("dst"), 0, 64))],
                notify=b"n%d" % i).wait(10)
    for i in range(3):  # 4 KB notes: the byte bound keeps two
        a.write(peer, [(Descriptor(src, 0, 64), Descriptor(peer.segment("dst"), 0, 64))],
                notify=bytes([i]) * 4000).wait(10)
    for _ in range(100):
        if len(seen) == 15:
            break
        time.sleep(0.02)
    assert len(seen) == 15  # every callback fired
    kept = b.notifications()
    assert [n.payload for n in kept] == [bytes([1]) * 4000, bytes([2]) * 4000]
    assert b.stats["notifications_dropped"] == 13 and b._notes.nbytes == 0
