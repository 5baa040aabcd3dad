"""A WRITE whose payload stops coming waits on the pump's poller, not on a worker:
rails stalled mid-payload, more of them than the pump has workers, cost the other peers
nothing; a parked payload lands whole and byte-exact when its bytes come; one whose
peer keeps silent is cut at its pace and frees its pins. Spoken by hand over real
loopback rails (``tests/helpers/rails.py``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.helpers.rails import SIZE, RawRail, handshake
from tests.helpers.transport_contract import random_bytes
from tests.test_attack_bounds import _legit_roundtrip_tcp
from transfer_engine import Engine
from transfer_engine.transport.shm import ShmTransport
from transfer_engine.transport.stream import (
    FLAG_IMM,
    HEADER,
    KIND_READ,
    KIND_WRITE,
    LOCAL_DT,
    pump,
)
from transfer_engine.transport.stream.io import PARK_AFTER
from transfer_engine.transport.tcp import TcpTransport

SERVE = pytest.mark.parametrize("serve", ["thread", "process"])


def _target(make_engine: Callable[..., Engine], stall: float, serve: str
            ) -> tuple[Engine, int]:
    """An engine serving tcp (from its own threads or its serving process) with a
    stall timeout of ``stall`` and a random 1 MiB segment, ``kv``."""
    b = make_engine("victim", transports=[TcpTransport(stall_timeout=stall, serve=serve)])
    return b, b.register(random_bytes(SIZE, 12), name="kv").id


def _write_head(seg_id: int, length: int, wr_id: int = 1, offset: int = 0) -> bytes:
    return (HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, wr_id, 0, 0)
            + np.array([seg_id, offset, length], dtype="<u8").tobytes())


def _write_with_a_pause(b: Engine, rail: RawRail, seg_id: int, seed: int,
                        pause: float = 3 * PARK_AFTER) -> None:
    """A WRITE of the whole segment: half its payload, a pause past the park, the
    other half; answered with success, every byte where it belongs."""
    data = random_bytes(SIZE, seed).tobytes()
    rail.sock.sendall(_write_head(seg_id, SIZE) + data[:SIZE // 2])
    time.sleep(pause)
    rail.sock.sendall(data[SIZE // 2:])
    assert rail.answer()[0] == 0
    assert b.segments["kv"].view().tobytes() == data


def _serves_the_next(b: Engine, rail: RawRail, seg_id: int, seed: int) -> None:
    """The rail serves the next request, a 4 KiB WRITE, at once and byte-exact."""
    more = random_bytes(4096, seed).tobytes()
    rail.sock.sendall(_write_head(seg_id, 4096, 2) + more)
    assert rail.answer()[0] == 0
    assert b.segments["kv"].view()[:4096].tobytes() == more


def _stopped_rails(b: Engine, name: str, sent: bytes, count: int) -> list[RawRail]:
    """``count`` rails of peer ``name``, each of which sent ``sent`` and then nothing."""
    _, credential = handshake(b, name)
    rails: list[RawRail] = []
    try:
        for _ in range(count):
            rail = RawRail(b, credential)
            assert rail.status == 0
            rail.sock.sendall(sent)
            rails.append(rail)
    except BaseException:
        for rail in rails:
            rail.close()
        raise
    return rails


def _others_served(b: Engine, stall: float, settle: float) -> None:
    """After ``settle`` seconds, another peer's 4 KiB WRITE takes well under half of
    ``stall``."""
    time.sleep(settle)
    started = time.monotonic()
    _legit_roundtrip_tcp(b)
    assert time.monotonic() - started < stall / 2


@SERVE
def test_payloads_stalled_on_more_rails_than_workers_leave_the_others_served(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """Before, each rail stalled mid-payload held a pump worker until its pace ran
    out (here 6 s): with more such rails than the pump may have workers, another
    peer's 4 KiB WRITE waited that long. Now each waits on the poller after a tenth of
    a second, and is cut once its pace runs out, leaving nothing pinned."""
    stall = 6.0
    b, seg_id = _target(make_engine, stall, serve)
    rails = _stopped_rails(b, "staller", _write_head(seg_id, SIZE) + b"\x05" * 1024,
                           4 * pump.worker_count() + 8)
    try:
        _others_served(b, stall, 2 * PARK_AFTER)
        deadline = time.monotonic() + stall + 5
        for rail in rails:  # each cut by the pump's timer: none of their bytes came
            assert rail.closed_by_target(timeout=max(0.1, deadline - time.monotonic()))
        if serve == "thread":  # what they held while parked is given back
            assert b.transports["tcp"]._server.parking.held == 0  # type: ignore[attr-defined]
    finally:
        for rail in rails:
            rail.close()
    closing = time.monotonic()
    b.segments["kv"].close(timeout=5)  # no pin left: returns at once
    assert time.monotonic() - closing < 1


@SERVE
def test_a_parked_payload_lands_whole_when_the_rest_comes(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """Half a payload, a pause past the park, the other half: one answer, success,
    every byte where it belongs; and the rail serves the next request as before."""
    b, seg_id = _target(make_engine, 5.0, serve)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        _write_with_a_pause(b, rail, seg_id, 21)
        _serves_the_next(b, rail, seg_id, 22)
    finally:
        rail.close()


@SERVE
def test_closing_a_segment_under_a_parked_payload_tears_its_rail_down(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """A parked WRITE holds its segment pinned; closing the segment tears the rail
    down after the close's timeout (as for a stalled peer on a worker), and the pin
    goes then, long before the peer's pace would run out."""
    b, seg_id = _target(make_engine, 20.0, serve)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        rail.sock.sendall(_write_head(seg_id, SIZE) + b"\x06" * 4096)
        time.sleep(3 * PARK_AFTER)
        started = time.monotonic()
        b.segments["kv"].close(timeout=0.5)  # raises if the pin stays past the grace
        assert time.monotonic() - started < 3
        assert rail.closed_by_target()
    finally:
        rail.close()


def test_past_the_parking_bound_a_stalled_payload_waits_on_its_worker(
        make_engine: Callable[..., Engine]) -> None:
    """What parked requests hold is bounded per server (their bodies and bounces):
    past the bound a request waits for its peer on its worker, as before, without
    spinning (a parked step's calls do not wait), and still lands whole; parking's
    account returns to nothing."""
    b, seg_id = _target(make_engine, 5.0, "thread")
    parking = b.transports["tcp"]._server.parking  # type: ignore[attr-defined]
    parking.limit = 0
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    random_bytes(SIZE, 23)  # drawn before the CPU is counted
    cpu = time.process_time()
    try:
        _write_with_a_pause(b, rail, seg_id, 23, pause=1.0)
    finally:
        rail.close()
    assert time.process_time() - cpu < 0.5
    assert parking.refused >= 1 and parking.held == 0


@SERVE
def test_answers_read_by_nobody_on_more_rails_than_workers_leave_the_others_served(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """The sending side: READs of 8 MiB on more rails than the pump may have workers,
    whose peers never read their answers, once held a worker each until the stall (6
    s) cut them; now each answer waits on the poller for room to send, another peer's
    WRITE goes through meanwhile, and closing those rails frees what they held."""
    stall = 6.0
    b, seg_id = _target(make_engine, stall, serve)
    head = (HEADER.pack(KIND_READ, 0, 8, 0, 0, 0, 1, 0, 0)
            + np.array([[seg_id, 0, SIZE]] * 8, dtype="<u8").tobytes())
    rails = _stopped_rails(b, "nonreader", head, 4 * pump.worker_count() + 4)
    try:
        _others_served(b, stall, 3 * PARK_AFTER)
    finally:
        for rail in rails:
            rail.close()
    closing = time.monotonic()
    b.segments["kv"].close(timeout=5)  # the answers' pins go with their rails
    assert time.monotonic() - closing < 2
    if serve == "thread":
        assert b.transports["tcp"]._server.parking.held == 0  # type: ignore[attr-defined]


@SERVE
def test_an_answer_parked_for_a_slow_reader_arrives_whole(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """A READ of 8 MiB whose reader takes nothing for a while (its answer parks) and
    then reads: the whole answer, byte-exact, and the rail serves the next READ."""
    b, seg_id = _target(make_engine, 5.0, serve)
    mem = b.segments["kv"].view().tobytes()
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        rail.sock.sendall(HEADER.pack(KIND_READ, 0, 8, 0, 0, 0, 1, 0, 0)
                          + np.array([[seg_id, 0, SIZE]] * 8, dtype="<u8").tobytes())
        time.sleep(3 * PARK_AFTER)
        status, _ = rail.answer()
        assert status == 0
        assert rail.recv(8 * SIZE) == mem * 8
        rail.sock.sendall(HEADER.pack(KIND_READ, 0, 1, 0, 0, 0, 2, 0, 0)
                          + np.array([seg_id, 4096, 4096], dtype="<u8").tobytes())
        assert rail.answer()[0] == 0
        assert rail.recv(4096) == mem[4096:8192]
    finally:
        rail.close()


def _imm_write(seg_id: int, payload: bytes, notify: bytes, tid: int) -> list[bytes]:
    """A WRITE with a notification, as its header, entries, body and payload."""
    return [HEADER.pack(KIND_WRITE, FLAG_IMM, 1, 0, 0, len(notify), tid, tid, 1),
            np.array([seg_id, 0, len(payload)], dtype="<u8").tobytes(), notify, payload]


@SERVE
@pytest.mark.parametrize("stop", ["header", "entries", "body"])
def test_requests_stalled_before_their_payload_leave_the_others_served(
        make_engine: Callable[..., Engine], serve: str, stop: str) -> None:
    """Before, a rail whose peer sent part of a request's header, of its entries or of
    its notification body, and then nothing, held a pump worker until its pace ran out
    (a stall: 6 s here): with more such rails than the pump may have workers, another
    peer's 4 KiB WRITE timed out. Now such a request waits on the poller as a stalled
    payload does, and is cut at its pace."""
    stall = 6.0
    b, seg_id = _target(make_engine, stall, serve)
    head, entries, notify, _ = _imm_write(seg_id, b"\x07" * 4096, b"n" * 1000, 3)
    sent = {"header": head[:7], "entries": head + entries[:5],
            "body": head + entries + notify[:1]}[stop]
    rails = _stopped_rails(b, "staller", sent, 4 * pump.worker_count() + 8)
    try:
        _others_served(b, stall, 2 * PARK_AFTER)
        deadline = time.monotonic() + stall + 5
        for rail in rails:
            assert rail.closed_by_target(timeout=max(0.1, deadline - time.monotonic()))
        if serve == "thread":
            assert b.transports["tcp"]._server.parking.held == 0  # type: ignore[attr-defined]
    finally:
        for rail in rails:
            rail.close()
    assert b.notifications(timeout=0.2) == []


@SERVE
def test_a_request_sent_in_pieces_with_pauses_is_served_once_and_whole(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """Header, entries, notification body and payload, each cut in two with a pause
    past the park between: one answer, success, the bytes where they belong and the
    notification delivered once; the rail then serves the next request at once."""
    b, seg_id = _target(make_engine, 5.0, serve)
    _, credential = handshake(b, "pieces")
    rail = RawRail(b, credential)
    payload = random_bytes(SIZE, 31).tobytes()
    try:
        for part in _imm_write(seg_id, payload, b"note-31", 31):
            half = max(1, len(part) // 2)
            rail.sock.sendall(part[:half])
            time.sleep(2 * PARK_AFTER)
            rail.sock.sendall(part[half:])
        assert rail.answer()[0] == 0
        assert b.segments["kv"].view().tobytes() == payload
        notes = b.notifications(timeout=5)
        assert [(n.peer, n.payload) for n in notes] == [("pieces", b"note-31")]
        _serves_the_next(b, rail, seg_id, 32)
    finally:
        rail.close()
    assert b.notifications(timeout=0.3) == []


@contextlib.contextmanager
def _trickling(rails: list[RawRail], act: Callable[[socket.socket], object]
               ) -> Iterator[None]:
    """``act`` on every rail's socket twice per :data:`PARK_AFTER` meanwhile; the
    rails are closed after."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(PARK_AFTER / 2):
            for rail in rails:
                with contextlib.suppress(OSError):
                    act(rail.sock)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        for rail in rails:
            rail.close()


@SERVE
def test_payloads_trickled_faster_than_the_park_leave_the_others_served(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """Before, a payload whose peer sent a byte more often than every tenth of a
    second never parked: each such rail held a pump worker until its pace ran out, and
    with more of them than the pump may have workers, another peer's WRITE waited for
    them. Now a request parks once a receive has not brought everything, and takes
    only what the socket holds whenever it turns readable."""
    stall = 6.0
    b, seg_id = _target(make_engine, stall, serve)
    # into the segment's second half: the other peer writes its first 4 KiB
    rails = _stopped_rails(b, "trickler", _write_head(seg_id, SIZE // 2, 1, SIZE // 2)
                           + b"\x08", 4 * pump.worker_count() + 8)
    with _trickling(rails, lambda sock: sock.send(b"\x08")):
        _others_served(b, stall, 3 * PARK_AFTER)
        _others_served(b, stall, 0)
    closing = time.monotonic()
    b.segments["kv"].close(timeout=5)  # their pins go with their rails
    assert time.monotonic() - closing < 2


@SERVE
def test_answers_read_at_a_trickle_leave_the_others_served(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """The sending side: readers that take 4 KiB of their 8 MiB answers twice per
    park, on more rails than the pump may have workers. Each answer waits on the
    poller for room, sending what the socket takes at each wake-up, and another peer's
    WRITE goes through meanwhile."""
    stall = 6.0
    b, seg_id = _target(make_engine, stall, serve)
    head = (HEADER.pack(KIND_READ, 0, 8, 0, 0, 0, 1, 0, 0)
            + np.array([[seg_id, 0, SIZE]] * 8, dtype="<u8").tobytes())
    rails = _stopped_rails(b, "sipper", head, 4 * pump.worker_count() + 4)
    for rail in rails:
        rail.sock.setblocking(False)
    with _trickling(rails, lambda sock: sock.recv(4096)):
        _others_served(b, stall, 3 * PARK_AFTER)
        _others_served(b, stall, 0)
    closing = time.monotonic()
    b.segments["kv"].close(timeout=5)
    assert time.monotonic() - closing < 2


@SERVE
def test_shm_requests_trickled_in_are_served_whole(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """Over a unix socket, whose readiness ignores a low-water mark, a parked
    request that got a trickle waits a pause before it looks again (a wake-up per
    byte would cost a worker's call each): 8 rails whose notification bodies come a
    byte at a time are each served whole, the bytes copied from the announced range
    and each notification delivered once."""
    b = make_engine("victim", transports=[ShmTransport(serve=serve, stall_timeout=5.0)])
    seg = b.register(np.zeros(SIZE, dtype=np.uint8), name="kv")
    ours = random_bytes(8 * 4096, 51)
    announced = np.array([(ours.ctypes.data, ours.nbytes, 1)], dtype=np.uint64)
    _, credential = handshake(b, "dripper")
    rails = [RawRail(b, credential, "shm", ranges=announced) for _ in range(8)]
    try:
        notes = [f"note-{i}-".encode() * 3 for i in range(len(rails))]
        for i, (rail, note) in enumerate(zip(rails, notes, strict=True)):
            assert rail.status == 0
            local = np.array([(ours.ctypes.data + i * 4096, 4096)], dtype=LOCAL_DT)
            rail.sock.sendall(HEADER.pack(KIND_WRITE, FLAG_IMM, 1, 1, 0, len(note), 1,
                                          100 + i, 1)
                              + np.array([seg.id, i * 4096, 4096], dtype="<u8").tobytes()
                              + local.tobytes())
        time.sleep(2 * PARK_AFTER)  # each request parks on its body
        for k in range(len(notes[0])):
            for rail, note in zip(rails, notes, strict=True):
                rail.sock.send(note[k:k + 1])
            time.sleep(0.002)
        for rail in rails:
            assert rail.answer()[0] == 0
    finally:
        for rail in rails:
            rail.close()
    assert seg.view().tobytes()[:8 * 4096] == ours.tobytes()
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 10
    while len(got) < len(notes) and time.monotonic() < deadline:
        got += [(n.peer, n.payload) for n in b.notifications(timeout=1)]
    assert sorted(got) == sorted(("dripper", n) for n in notes)
    assert b.notifications(timeout=0.3) == []
