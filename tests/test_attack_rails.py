"""Attacks on the data plane, spoken by hand to every rail port an engine opens.

Each case ends with the attacker refused, having learnt nothing, and the legitimate
peers' bytes exact.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.helpers.rails import (
    SIZE,
    RawRail,
    connect_raw,
    handshake,
    hello_frame,
    tight_tcp,
)
from tests.helpers.transport_contract import random_bytes
from transfer_engine import Descriptor, Engine
from transfer_engine.errors import AuthenticationError, InvalidDescriptorError
from transfer_engine.transport.shm import ShmTransport
from transfer_engine.transport.stream import (
    HEADER,
    KIND_READ,
    KIND_WRITE,
    LOCAL_DT,
    MAX_OPENING,
    unpack_error,
)
from transfer_engine.transport.tcp import TcpTransport

SECRET = "a-secret-of-at-least-16-bytes"
TRANSPORTS = ["tcp", "shm"]


def _refused(rail: RawRail, transport: str) -> None:
    """The target answered a bare refusal that names nothing, then closed."""
    status, body = rail.answer()
    err = unpack_error(body, status, "?", "connect", transport)
    assert isinstance(err, AuthenticationError)
    assert err.message == "rail refused" and err.segment is None and err.length is None
    assert b"kv" not in body and str(SIZE).encode() not in body
    assert rail.closed_by_target()


def _legit_roundtrip(make_engine: Callable[..., Engine], b: Engine, mem: np.ndarray,
                     transports: list[str]) -> None:
    a = make_engine("legit", transports=transports)
    src = random_bytes(8192, 99)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    h = a.write(peer, [(Descriptor(seg, 0, 8192), Descriptor(peer.segment("kv"), 4096, 8192))],
                notify=b"ok")
    h.wait(10)
    assert h.transport == transports[0]
    assert bytes(mem[4096:4096 + 8192]) == src.tobytes()
    note = b.notifications(timeout=5)
    assert [(n.peer, n.payload) for n in note] == [("legit", b"ok")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_request_without_an_opening_is_refused(
        make_engine: Callable[..., Engine], victim: tuple[Engine, np.ndarray, int],
        transport: str) -> None:
    b, mem, seg_id = victim
    before = mem.copy()
    rail = RawRail(b, None, transport)
    try:
        # straight to a WRITE of a guessed segment, as the old wire allowed
        head = HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
        rail.sock.sendall(head + np.array([seg_id, 0, 64], dtype="<u8").tobytes()
                          + b"\xee" * 64)
        _refused(rail, transport)
    finally:
        rail.close()
    assert np.array_equal(mem, before)
    _legit_roundtrip(make_engine, b, mem, [transport])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_forged_ticket_is_refused(make_engine: Callable[..., Engine],
                                    victim: tuple[Engine, np.ndarray, int],
                                    transport: str) -> None:
    b, mem, _ = victim
    rail = RawRail(b, None, transport)
    try:
        rail.sock.sendall(hello_frame(None, transport, rail.challenge))
        _refused(rail, transport)
    finally:
        rail.close()
    _legit_roundtrip(make_engine, b, mem, [transport])


def test_a_replayed_opening_is_refused(victim: tuple[Engine, np.ndarray, int]) -> None:
    """An opening recorded on the wire does not open another connection: each has its
    own challenge."""
    b, _, _ = victim
    _, credential = handshake(b)
    first = RawRail(b, None)
    recorded = hello_frame(credential, "tcp", first.challenge)
    first.sock.sendall(recorded)
    assert first.answer()[0] == 0
    second = RawRail(b, None)
    try:
        second.sock.sendall(recorded)
        _refused(second, "tcp")
    finally:
        first.close()
        second.close()


def test_a_tcp_ticket_does_not_open_another_transport(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    b, _, _ = victim
    _, credential = handshake(b)
    rail = RawRail(b, None, "shm")
    try:
        rail.sock.sendall(hello_frame(credential, "tcp", rail.challenge))  # proof for tcp
        _refused(rail, "shm")
    finally:
        rail.close()


MALFORMED = {
    "empty": b"",  # nothing at all, then close
    "truncated": b"\x00" * 7,  # a truncated header
    "huge-body": HEADER.pack(1, 0, 0, 0, 0, 1 << 30, 0, 0, 0),  # a hello claiming 1 GiB
    "not-msgpack": HEADER.pack(1, 0, 0, 0, 0, 5, 0, 0, 0) + b"\xc1\xc1\xc1\xc1\xc1",
    "not-a-map": HEADER.pack(1, 0, 0, 0, 0, 1, 0, 0, 0) + b"\x90",  # msgpack, no map
    "unknown-kind": HEADER.pack(9, 0, 0, 0, 0, 0, 0, 0, 0),
    "noise": bytes(random_bytes(4096, 31)),
}


def _send_malformed(b: Engine, transport: str, frame: bytes) -> None:
    """Sends ``frame`` as a rail's opening; the target must close the connection."""
    rail = RawRail(b, None, transport)
    try:
        try:
            rail.sock.sendall(frame)
            if frame:
                rail.sock.shutdown(socket.SHUT_WR)  # a truncated frame ends there
        except OSError:  # the target hung up already
            pass
        assert rail.closed_by_target(timeout=10)
    finally:
        rail.close()


@pytest.mark.parametrize("frame", list(MALFORMED.values()), ids=list(MALFORMED))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_malformed_openings_cost_nothing(make_engine: Callable[..., Engine],
                                         victim: tuple[Engine, np.ndarray, int],
                                         transport: str, frame: bytes,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer_engine.transport.stream import server  # noqa: PLC0415

    b, mem, _ = victim
    before = mem.copy()
    if not frame:  # a silent opening is dropped when the opening timer runs out
        monkeypatch.setattr(server, "HELLO_TIMEOUT", 1.0)
    _send_malformed(b, transport, frame)
    monkeypatch.undo()  # the legitimate peer opens under the usual timer
    assert np.array_equal(mem, before)
    _legit_roundtrip(make_engine, b, mem, [transport])


def test_a_serving_process_takes_malformed_openings_and_bad_requests_in_its_stride(
        make_engine: Callable[..., Engine]) -> None:
    """The same openings, and requests a ticket's holder gets wrong, against a target
    served from a serving process (the Mooncake drop-in's default): each is refused
    or closed, the memory is untouched, and the same serving process goes on serving
    both transports."""
    from tests.helpers.serving import serve_pid  # noqa: PLC0415

    b = make_engine("victim", transports=["shm", "tcp"], serve="process")
    mem = random_bytes(SIZE, 11)
    seg_id = b.register(mem, name="kv").id
    pid = serve_pid(b)
    before = mem.copy()
    for transport in TRANSPORTS:
        for name, frame in MALFORMED.items():
            if name != "empty":  # a silent opening waits out the opening timer (5 s)
                _send_malformed(b, transport, frame)
    _, credential = handshake(b)
    for entries in ([(seg_id, SIZE - 8, 64)], [(seg_id + 7, 0, 64)],
                    [(seg_id, 1 << 62, 64)]):  # past the end, no such segment, overflow
        rail = RawRail(b, credential)
        try:
            status, body = rail.request(KIND_WRITE, entries, b"\xee" * 64)
            assert isinstance(unpack_error(body, status, "?", "write", "tcp"),
                              InvalidDescriptorError)
        finally:
            rail.close()
    assert np.array_equal(mem, before)
    assert serve_pid(b) == pid  # no respawn: nothing reached it as a crash
    _legit_roundtrip(make_engine, b, mem, ["tcp"])
    _legit_roundtrip(make_engine, b, mem, ["shm", "tcp"])


def test_with_a_secret_the_welcome_carries_no_key_and_a_sniffed_ticket_opens_nothing(
        make_engine: Callable[..., Engine]) -> None:
    b = make_engine("victim", transports=["tcp"], auth=SECRET)
    b.register(random_bytes(SIZE, 3), name="kv")
    welcome, credential = handshake(b, secret=SECRET)
    assert set(welcome.ticket) == {"id"}  # the key is derived, never sent
    # someone who saw the Welcome but lacks the secret
    from transfer_engine.control.tickets import Credential
    guess = Credential(welcome.ticket["id"], os.urandom(32))
    rail = RawRail(b, None)
    try:
        rail.sock.sendall(hello_frame(guess, "tcp", rail.challenge))
        _refused(rail, "tcp")
    finally:
        rail.close()
    good = RawRail(b, credential)  # the secret's holder derives the key
    try:
        assert good.status == 0
    finally:
        good.close()


def test_engines_with_different_secrets_do_not_connect(
        make_engine: Callable[..., Engine]) -> None:
    b = make_engine("victim", transports=["tcp"], auth=SECRET)
    a = make_engine("intruder", transports=["tcp"], auth="another-secret-16-bytes")
    with pytest.raises(AuthenticationError):
        a.connect(b.endpoint, timeout=2)
    c = make_engine("stranger", transports=["tcp"])  # no secret at all
    with pytest.raises(AuthenticationError):
        c.connect(b.endpoint, timeout=2)


def test_a_rail_speaks_only_for_its_tickets_peer(victim: tuple[Engine, np.ndarray, int]
                                                 ) -> None:
    """Notifications on a rail are its ticket's peer's, whatever else it claims."""
    b, mem, seg_id = victim
    _, credential = handshake(b, name="mallory")
    rail = RawRail(b, credential)
    try:
        head = HEADER.pack(KIND_WRITE, 1, 1, 0, 0, len(b"fake"), 7, 99, 1)
        payload = random_bytes(64, 5).tobytes()
        rail.sock.sendall(head + np.array([seg_id, 0, 64], dtype="<u8").tobytes() + b"fake"
                          + payload)
        assert rail.answer()[0] == 0
    finally:
        rail.close()
    notes = b.notifications(timeout=5)
    assert [(n.peer, n.payload) for n in notes] == [("mallory", b"fake")]
    assert bytes(mem[:64]) == payload


def _write_imm(rail: RawRail, seg_id: int, offset: int, tid: int, notify: bytes,
               wr_id: int | None = None, flags: int = 1) -> None:
    payload = random_bytes(64, tid).tobytes()
    head = HEADER.pack(KIND_WRITE, flags, 1, 0, 0, len(notify),
                       tid if wr_id is None else wr_id, tid, 2)
    rail.sock.sendall(head + np.array([seg_id, offset, 64], dtype="<u8").tobytes() + notify
                      + payload)
    assert rail.answer()[0] == 0


def test_an_impostor_under_the_same_name_cannot_complete_a_count(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    """Without a secret anyone on loopback may handshake as "prefill-0"; immediates
    still count per connection, so the impostor cannot fire the real peer's
    notification before its bytes landed."""
    b, _, seg_id = victim
    _, real = handshake(b, name="prefill-0")
    _, fake = handshake(b, name="prefill-0")
    first, second = RawRail(b, real), RawRail(b, real)
    impostor = RawRail(b, fake)
    try:
        _write_imm(first, seg_id, 0, 5, b"real")  # one of two rails landed
        _write_imm(impostor, seg_id, 4096, 5, b"")  # the same transfer id and count
        assert b.notifications(timeout=0.3) == []
        _write_imm(second, seg_id, 8192, 5, b"")  # the real second rail
        notes = b.notifications(timeout=5)
        assert [(n.peer, n.payload) for n in notes] == [("prefill-0", b"real")]
    finally:
        for rail in (first, second, impostor):
            rail.close()


def test_a_resent_work_counts_once_and_only_when_marked(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    """A work sent again on another rail (marked resent: flags 4) after it landed does
    not complete its transfer's count; the same work id unmarked on another rail (a
    client that numbers works per rail) counts as any other."""
    b, _, seg_id = victim
    _, credential = handshake(b, name="prefill-0")
    first, second = RawRail(b, credential), RawRail(b, credential)
    try:
        _write_imm(first, seg_id, 0, 9, b"nine", wr_id=100)
        _write_imm(second, seg_id, 0, 9, b"", wr_id=100, flags=1 | 4)  # resent
        assert b.notifications(timeout=0.3) == []
        assert b.stats["notify_duplicates"] == 1
        _write_imm(second, seg_id, 4096, 9, b"", wr_id=101)
        assert [n.payload for n in b.notifications(timeout=5)] == [b"nine"]
        _write_imm(first, seg_id, 0, 10, b"ten", wr_id=7)
        _write_imm(second, seg_id, 0, 10, b"", wr_id=7)  # per-rail numbering: counts
        assert [n.payload for n in b.notifications(timeout=5)] == [b"ten"]
    finally:
        first.close()
        second.close()


def test_a_ticket_opens_a_bounded_number_of_rails(victim: tuple[Engine, np.ndarray, int]
                                                  ) -> None:
    b, _, _ = victim
    _, credential = handshake(b)
    limit = b.rails_per_ticket
    rails = []
    try:
        for _ in range(limit):
            rails.append(RawRail(b, credential))
            assert rails[-1].status == 0
        extra = RawRail(b, None)
        rails.append(extra)
        extra.sock.sendall(hello_frame(credential, "tcp", extra.challenge))
        status, body = extra.answer()
        assert isinstance(unpack_error(body, status, "?", "connect", "tcp"),
                          AuthenticationError)
    finally:
        for rail in rails:
            rail.close()


def test_a_name_past_the_bound_gets_no_ticket(make_engine: Callable[..., Engine]) -> None:
    """A peer's name travels with every rail and every immediate relayed from a serving
    process: a hello naming itself with megabytes gets no ticket (a 3 MB name once took
    the serving process's link down, and every peer's rails with it), and the serving
    process goes on serving."""
    b = make_engine("victim", transports=["tcp"], serve="process")
    mem = random_bytes(SIZE, 11)
    b.register(mem, name="kv")
    with pytest.raises(AssertionError):  # an error reply, not a Welcome
        handshake(b, name="m" * 3_000_000)
    with pytest.raises(AssertionError):
        handshake(b, name="m" * 1025)
    handshake(b, name="m" * 1024)
    with pytest.raises(ValueError, match="1 to 1024 characters"):
        Engine("n" * 1025)
    _legit_roundtrip(make_engine, b, mem, ["tcp"])


def test_a_crowd_of_stalled_openings_does_not_lock_a_peer_out(
        make_engine: Callable[..., Engine], victim: tuple[Engine, np.ndarray, int]) -> None:
    b, mem, _ = victim
    crowd = [connect_raw(b, "tcp") for _ in range(MAX_OPENING + 16)]
    try:
        _legit_roundtrip(make_engine, b, mem, ["tcp"])
    finally:
        for sock in crowd:
            sock.close()


def test_a_rail_stalled_mid_write_is_dropped_and_its_segment_freed(
        make_engine: Callable[..., Engine]) -> None:
    b, mem, seg_id = tight_tcp(make_engine, 0.3)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        head = HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
        rail.sock.sendall(head + np.array([seg_id, 0, SIZE], dtype="<u8").tobytes()
                          + b"\x01" * 1000)  # then nothing more
        assert rail.closed_by_target(timeout=10)
    finally:
        rail.close()
    started = time.monotonic()
    b.segments["kv"].close(timeout=5)  # no pin is left behind
    assert time.monotonic() - started < 3  # a pin left would wait out the 5 s


def test_an_idle_rail_stays_open(make_engine: Callable[..., Engine]) -> None:
    b, mem, seg_id = tight_tcp(make_engine, 0.2)
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        time.sleep(0.7)  # idle for several stall timeouts
        status, _ = rail.request(KIND_READ, [(seg_id, 128, 256)])
        assert status == 0 and rail.recv(256) == mem[128:384].tobytes()
    finally:
        rail.close()


def test_revoke_tears_down_a_rail_that_holds_a_segment(
        make_engine: Callable[..., Engine], victim: tuple[Engine, np.ndarray, int]) -> None:
    """A peer stalled mid-WRITE (well within the stall timeout) loses its rail when the
    segment's owner revokes it, and the segment's pin drops."""
    b, mem, seg_id = victim
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    seg = b.segments["kv"]
    try:
        head = HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
        rail.sock.sendall(head + np.array([seg_id, 0, SIZE], dtype="<u8").tobytes()
                          + b"\x01" * 1000)
        deadline = time.monotonic() + 5
        while seg.pins == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seg.pins == 1
        b.transports["tcp"].revoke(seg)
        assert rail.closed_by_target(timeout=5)
        deadline = time.monotonic() + 5
        while seg.pins and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seg.pins == 0
    finally:
        rail.close()
    _legit_roundtrip(make_engine, b, mem, ["tcp"])


def test_the_acceptor_survives_fd_exhaustion(make_engine: Callable[..., Engine],
                                             victim: tuple[Engine, np.ndarray, int]) -> None:
    b, mem, _ = victim
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened = len(os.listdir("/proc/self/fd"))
    flood: list[socket.socket] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 40, hard))
        for _ in range(200):  # our own sockets and the acceptor's take the fds
            try:
                flood.append(connect_raw(b, "tcp"))
            except OSError:
                break
        deadline = time.monotonic() + 5
        stats = b.transports["tcp"].info("server_stats")
        while not stats.get("accept_errors") and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = b.transports["tcp"].info("server_stats")
        assert stats.get("accept_errors"), "the flood never exhausted the fds"
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _legit_roundtrip(make_engine, b, mem, ["tcp"])


# --- shared memory: the kernel's word on who is at the other end -----------------------


def test_shm_refuses_a_claimed_pid(victim: tuple[Engine, np.ndarray, int]) -> None:
    """The handshake names a process (here the victim's own); the socket's peer is us:
    the rail does not open, and so the victim never copies its own unregistered memory."""
    b, _, _ = victim
    _, credential = handshake(b, pid=os.getpid() + 1 if os.getpid() > 2 else 1)
    rail = RawRail(b, None, "shm")
    try:
        rail.sock.sendall(hello_frame(credential, "shm", rail.challenge))
        _refused(rail, "shm")
    finally:
        rail.close()


def _local_rows(address: int, length: int) -> bytes:
    return np.array([(address, length)], dtype=LOCAL_DT).tobytes()


def test_shm_copies_only_within_announced_ranges(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    b, mem, seg_id = victim
    ours = random_bytes(4096, 21)
    hidden = random_bytes(4096, 22)  # ours, but never announced
    announced = np.array([(ours.ctypes.data, ours.nbytes, 1)], dtype=np.uint64)
    _, credential = handshake(b)
    rail = RawRail(b, credential, "shm", ranges=announced)
    before = mem.copy()
    try:
        assert rail.status == 0
        # a WRITE from memory we did not announce
        status, body = rail.request(KIND_WRITE, [(seg_id, 0, 4096)],
                                    local=_local_rows(hidden.ctypes.data, 4096), n_local=1)
        assert isinstance(unpack_error(body, status, "?", "write", "shm"),
                          InvalidDescriptorError)
        # a range that starts inside the announced one and runs past it
        status, body = rail.request(KIND_READ, [(seg_id, 0, 4096)],
                                    local=_local_rows(ours.ctypes.data + 8, 4096), n_local=1)
        assert status != 0
        assert np.array_equal(mem, before)
        # within the announcement: served
        status, _ = rail.request(KIND_WRITE, [(seg_id, 8192, 4096)],
                                 local=_local_rows(ours.ctypes.data, 4096), n_local=1)
        assert status == 0 and bytes(mem[8192:12288]) == ours.tobytes()
    finally:
        rail.close()


def test_shm_read_into_a_read_only_announced_range_is_refused(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    b, _, seg_id = victim
    ours = random_bytes(4096, 23)
    kept = ours.copy()
    announced = np.array([(ours.ctypes.data, ours.nbytes, 0)], dtype=np.uint64)
    _, credential = handshake(b)
    rail = RawRail(b, credential, "shm", ranges=announced)
    try:
        status, _ = rail.request(KIND_READ, [(seg_id, 0, 4096)],
                                 local=_local_rows(ours.ctypes.data, 4096), n_local=1)
        assert status != 0 and np.array_equal(ours, kept)
    finally:
        rail.close()


def test_shm_socket_is_private(victim: tuple[Engine, np.ndarray, int]) -> None:
    b, _, _ = victim
    path = b.metadata()["transports"]["shm"]["path"]
    folder = os.path.dirname(path)
    assert os.stat(folder).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_another_user_cannot_reach_the_shm_socket(
        victim: tuple[Engine, np.ndarray, int]) -> None:
    b, _, _ = victim
    path = b.metadata()["transports"]["shm"]["path"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, then try the socket
        code = 0
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                code = 1
            except PermissionError:
                code = 2
            except OSError:
                code = 3
            os.write(write, bytes([code]))
        finally:
            os._exit(0)
    os.close(write)
    try:
        result = os.read(read, 1)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert result == bytes([2])


def test_engine_without_a_secret_will_not_serve_beyond_loopback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TE_ALLOW_INSECURE", raising=False)
    monkeypatch.delenv("TE_CONTROL_SECRET", raising=False)
    with pytest.raises(ValueError, match="TE_CONTROL_SECRET"):
        Engine("exposed", host="0.0.0.0", transports=["tcp"])


def test_threads_of_refused_connections_end(victim: tuple[Engine, np.ndarray, int]) -> None:
    b, _, _ = victim
    socks = [connect_raw(b, "tcp") for _ in range(10)]
    for sock in socks:
        sock.sendall(os.urandom(64))
        sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        serving = [t for t in threading.enumerate() if t.name == "te-tcp-serve"]
        if not serving:
            break
        time.sleep(0.02)
    assert not [t for t in threading.enumerate() if t.name == "te-tcp-serve"]


def test_a_stale_transport_is_a_fresh_engine(make_engine: Callable[..., Engine]) -> None:
    """ShmTransport and TcpTransport validate their stall bound."""
    with pytest.raises(ValueError):
        TcpTransport(stall_timeout=0)
    with pytest.raises(ValueError):
        ShmTransport(stall_timeout=-1)
