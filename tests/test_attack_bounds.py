"""Bounds an authenticated peer meets on the data plane, spoken by hand: rails per
name over all its tickets, a full server letting a new peer in, payloads trickled in,
and announcements a transport does not read."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.helpers.rails import (
    SIZE,
    RawRail,
    handshake,
    tight_tcp,
)
from tests.helpers.transport_contract import random_bytes
from transfer_engine import Descriptor, Engine
from transfer_engine.transport.stream import HEADER, KIND_ANNOUNCE, KIND_WRITE, MAX_BODY


def test_tcp_keeps_no_range_announcement(victim: tuple[Engine, np.ndarray, int]) -> None:
    """Ranges are announced for shm (whose target copies from them); a tcp rail that
    sends them is closed, keeping nothing."""
    b, _, _ = victim
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        assert rail.status == 0
        rows = np.array([[0x10000, 4096, 1]] * 1000, dtype="<u8").tobytes()
        rail.sock.sendall(HEADER.pack(KIND_ANNOUNCE, 0, 0, 0, 0, len(rows), 0, 0, 0) + rows)
        assert rail.closed_by_target()
    finally:
        rail.close()


def test_a_name_holds_a_bounded_number_of_rails_over_all_its_tickets(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    """A peer that handshakes again for a fresh ticket every 64 rails (the book drops
    its old tickets, not their rails) still holds at most 4 x 64 under its name."""
    b, _, _ = victim
    limit = 4 * b.rails_per_ticket
    rails: list[RawRail] = []
    refused = False
    try:
        for i in range(limit + 64):
            if i % b.rails_per_ticket == 0:
                _, credential = handshake(b, "greedy")
            rail = RawRail(b, credential)
            rails.append(rail)
            if rail.status != 0:
                refused = True
                break
        assert refused and len(rails) == limit + 1
        _legit_roundtrip_tcp(b)
    finally:
        for rail in rails:
            rail.close()


def test_a_full_server_sheds_the_busiest_names_oldest_idle_rail(
        victim: tuple[Engine, np.ndarray, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """With every connection slot taken by idle rails, a new peer still gets in: the
    oldest idle rail of the name holding the most is closed to make room."""
    from transfer_engine.transport.stream import server as server_module  # noqa: PLC0415

    b, _, _ = victim
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 12)
    rails: list[RawRail] = []
    try:
        for name in ("greedy", "greedy", "other"):
            _, credential = handshake(b, name)
            for _ in range(4):
                rails.append(RawRail(b, credential))
                assert rails[-1].status == 0
        _legit_roundtrip_tcp(b)
        assert rails[0].closed_by_target(), "the busiest name's oldest rail stays"
        assert not rails[-1].closed_by_target(0.2)  # the others' stay open
    finally:
        for rail in rails:
            rail.close()


@pytest.mark.parametrize("part", ["payload", "body"])
def test_a_large_request_trickled_in_is_cut_after_two_stalls(
        make_engine: Callable[..., Engine], part: str) -> None:
    """The pace a request must keep is checked as it comes, not only against its whole
    size: a 1 MiB payload trickled in (whose average once allowed 16 s past a stall),
    or a request's entries and 1 MiB body (once with no bound at all), is cut after
    about two stalls, and the target serves others meanwhile and after."""
    b, _, seg_id = tight_tcp(make_engine, 0.5)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    started = time.monotonic()
    try:
        if part == "payload":
            rail.sock.sendall(HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
                              + np.array([seg_id, 0, SIZE], dtype="<u8").tobytes())
        else:
            rail.sock.sendall(HEADER.pack(KIND_WRITE, 0, 1, 0, 0, MAX_BODY, 1, 0, 0))
        assert _cut_while_trickling(rail, started, every=0.05, count=200)
        assert time.monotonic() - started < 4
        _legit_roundtrip_tcp(b)
    finally:
        rail.close()
    b.segments["kv"].close(timeout=5)  # no pin left: returns at once
    assert time.monotonic() - started < 10


def _cut_while_trickling(rail: RawRail, started: float, every: float, count: int) -> bool:
    """Sends a byte every ``every`` seconds, ``count`` at most; whether the target
    closed the rail meanwhile (looked for from a second on)."""
    for _ in range(count):
        try:
            rail.sock.sendall(b"\x01")
        except OSError:
            return True
        time.sleep(every)
        if time.monotonic() - started > 1.0 and rail.closed_by_target(timeout=0.02):
            return True
    return False


def _legit_roundtrip_tcp(b: Engine) -> None:
    """A fresh engine connects over tcp and writes, byte-exact."""
    import transfer_engine  # noqa: PLC0415

    data = random_bytes(4096, 5)
    with transfer_engine.Engine("legit", transports=["tcp"], timeout=5) as a:
        peer = a.connect(b.endpoint)
        a.write(peer, [(Descriptor(a.register(data), 0, 4096),
                        Descriptor(peer.segment("kv"), 0, 4096))]).wait(10)
    assert np.array_equal(b.segments["kv"].view()[:4096], data)


@pytest.mark.parametrize("refused", [False, True])
def test_a_trickled_write_is_dropped_in_bounded_time(
        make_engine: Callable[..., Engine], refused: bool) -> None:
    """A peer that sends a WRITE's payload a byte at a time, each well within the stall
    timeout, does not hold a serving thread: the payload must average 64 KiB/s past
    one stall, so this 4 KiB one is cut after about two stalls, nothing is left pinned,
    and the target serves others. So too the payload of a WRITE refused (an unknown
    segment), which the target takes off the stream (it once had no time bound)."""
    b, mem, seg_id = tight_tcp(make_engine, 0.5)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    started = time.monotonic()
    try:
        head = HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
        rail.sock.sendall(head + np.array([4242 if refused else seg_id, 0, 4096],
                                          dtype="<u8").tobytes())
        # a byte every 0.1 s would take 400 s
        assert _cut_while_trickling(rail, started, every=0.1, count=100)
        assert time.monotonic() - started < 5
    finally:
        rail.close()
    b.segments["kv"].close(timeout=5)  # no pin left: returns at once
    assert time.monotonic() - started < 6
