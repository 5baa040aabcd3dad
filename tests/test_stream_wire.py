"""The stream transports' wire format, spoken by hand to a real TCP target: hostile
entries are refused before any byte lands, and the connection stays in step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers.rails import RawRail, handshake, hello_frame
from tests.helpers.transport_contract import random_bytes
from transfer_engine import Engine, InvalidDescriptorError
from transfer_engine.errors import AuthenticationError
from transfer_engine.transport.stream import (
    FLAG_UNIFORM,
    HEADER,
    KIND_READ,
    KIND_WRITE,
    unpack_error,
)

SIZE = 1 << 20


@pytest.fixture
def target(make_engine: Callable[..., Engine]) -> Iterator[tuple[Engine, np.ndarray, list[int]]]:
    b = make_engine("b", transports=["tcp"])
    first = random_bytes(SIZE, 1)
    second = random_bytes(SIZE, 2)
    ids = [b.register(first, name="first").id, b.register(second, name="second").id]
    yield b, np.concatenate([first, second]), ids


@pytest.fixture
def raw(target: tuple[Engine, np.ndarray, list[int]]) -> Iterator[RawRail]:
    rail = RawRail(target[0], handshake(target[0])[1])
    try:
        assert rail.status == 0  # the hello's
        yield rail
    finally:
        rail.close()


def _memory(target: tuple[Engine, np.ndarray, list[int]]) -> np.ndarray:
    b, _, _ = target
    segs = b.segments
    return np.concatenate([np.frombuffer(segs[n].view(), dtype=np.uint8)
                           for n in ("first", "second")])


@pytest.mark.parametrize("entry", [
    (0, (1 << 64) - 8, 16),  # offset + length wraps around 2**64
    (0, SIZE - 8, 16),  # runs past the end
    (0, 0, 0),  # empty
    (0, 1 << 63, 8),  # negative as a signed offset
])
def test_hostile_entries_are_refused_and_the_rail_stays_in_step(
        target: tuple[Engine, np.ndarray, list[int]], raw: RawRail,
        entry: tuple[int, int, int]) -> None:
    _, _, ids = target
    before = _memory(target).copy()
    seg, offset, length = entry
    good = (ids[1], 4096, 8)
    status, body = raw.request(KIND_WRITE, [good, (ids[seg], offset, length)],
                               b"\xaa" * (8 + length))
    err = unpack_error(body, status, "b", "write", "tcp")
    assert status != 0 and isinstance(err, InvalidDescriptorError)
    assert err.offset == offset and err.length == length
    assert np.array_equal(_memory(target), before)  # not even the good entry landed
    # the refused payload was consumed: the next request is read correctly
    status, _ = raw.request(KIND_WRITE, [(ids[0], 100, 4), (ids[1], 200, 3)], b"abcdefg")
    assert status == 0
    after = _memory(target)
    assert bytes(after[100:104]) == b"abcd" and bytes(after[SIZE + 200:SIZE + 203]) == b"efg"


def test_read_gathers_entries_across_segments(target: tuple[Engine, np.ndarray, list[int]],
                                              raw: RawRail) -> None:
    _, _, ids = target
    memory = _memory(target)
    entries = [(ids[1], 5000, 300), (ids[0], 17, 1), (ids[1], 0, 4096), (ids[0], SIZE - 9, 9)]
    status, _ = raw.request(KIND_READ, entries)
    assert status == 0
    expected = b"".join(memory[(SIZE if s == ids[1] else 0) + o:][:n].tobytes()
                        for s, o, n in entries)
    assert raw.recv(len(expected)) == expected


def test_unknown_segment_is_refused(target: tuple[Engine, np.ndarray, list[int]],
                                    raw: RawRail) -> None:
    status, body = raw.request(KIND_WRITE, [(1 << 40, 0, 4)], b"zzzz")
    assert isinstance(unpack_error(body, status, "b", "write", "tcp"),
                      InvalidDescriptorError)
    status, _ = raw.request(KIND_READ, [(target[2][0], 0, 4)])
    assert status == 0 and raw.recv(4) == _memory(target)[:4].tobytes()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_version_rail_is_turned_away(target: tuple[Engine, np.ndarray, list[int]],
                                              version: int) -> None:
    rail = RawRail(target[0], None)
    try:
        _, credential = handshake(target[0])
        rail.sock.sendall(hello_frame(credential, "tcp", rail.challenge, version=version))
        status, body = rail.answer()
        assert isinstance(unpack_error(body, status, "b", "connect", "tcp"),
                          AuthenticationError)
        assert rail.closed_by_target()
    finally:
        rail.close()


def test_uniform_entries_write_and_read(target: tuple[Engine, np.ndarray, list[int]],
                                        raw: RawRail) -> None:
    _, _, ids = target
    offsets = [9000, 0, SIZE - 512, 4096]
    payload = random_bytes(512 * len(offsets), 7).tobytes()
    status, _ = raw.request_uniform(KIND_WRITE, ids[1], 512, offsets, payload)
    assert status == 0
    memory = _memory(target)
    for k, off in enumerate(offsets):
        assert memory[SIZE + off:SIZE + off + 512].tobytes() == payload[k * 512:][:512]
    status, _ = raw.request_uniform(KIND_READ, ids[1], 512, offsets[::-1])
    assert status == 0
    assert raw.recv(len(payload)) == b"".join(
        payload[k * 512:][:512] for k in reversed(range(len(offsets))))


@pytest.mark.parametrize("length,offset", [
    (16, (1 << 64) - 8),  # offset + length wraps around 2**64
    (16, SIZE - 8),  # runs past the end
    (0, 0),  # empty
    (8, 1 << 63),  # negative as a signed offset
    (SIZE + 1, 0),  # longer than the segment
])
def test_hostile_uniform_entries_are_refused_and_the_rail_stays_in_step(
        target: tuple[Engine, np.ndarray, list[int]], raw: RawRail, length: int,
        offset: int) -> None:
    _, _, ids = target
    before = _memory(target).copy()
    status, body = raw.request_uniform(KIND_WRITE, ids[0], length, [4096, offset],
                                       b"\xaa" * (2 * length))
    err = unpack_error(body, status, "b", "write", "tcp")
    assert status != 0 and isinstance(err, InvalidDescriptorError)
    assert err.length == length and err.segment == "first"
    assert np.array_equal(_memory(target), before)  # not even the good entry landed
    status, _ = raw.request_uniform(KIND_WRITE, ids[0], 4, [100, 200], b"abcdefgh")
    assert status == 0
    after = _memory(target)
    assert bytes(after[100:104]) == b"abcd" and bytes(after[200:204]) == b"efgh"


def test_uniform_entries_of_an_unknown_segment_are_refused(
        target: tuple[Engine, np.ndarray, list[int]], raw: RawRail) -> None:
    status, body = raw.request_uniform(KIND_READ, 1 << 40, 8, [0, 8])
    assert isinstance(unpack_error(body, status, "b", "read", "tcp"), InvalidDescriptorError)
    status, _ = raw.request_uniform(KIND_READ, target[2][0], 4, [0])
    assert status == 0 and raw.recv(4) == _memory(target)[:4].tobytes()


def test_engine_sends_blocks_of_one_length_as_uniform_entries(
        make_engine: Callable[..., Engine]) -> None:
    """The engine's own requests for Blocks of one length use the compact entries (the
    target counts them), and the bytes land where they should."""
    from transfer_engine import Blocks
    from transfer_engine.transport import stream

    seen: list[int] = []
    encode = stream.encode_request

    def spy(kind: int, work: Any, *args: Any, **kwargs: Any) -> bytes:
        data = encode(kind, work, *args, **kwargs)
        seen.append(HEADER.unpack_from(data)[1] & FLAG_UNIFORM)
        return data

    import transfer_engine.transport.tcp as tcp
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    src, dst = random_bytes(SIZE, 3), random_bytes(SIZE, 4)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    remote = peer.segment(b.register(dst).name)
    lo = np.array([4096 * 7, 0, 4096 * 3])
    ro = np.array([4096 * 100, 4096 * 5, 4096 * 9])
    tcp.encode_request = spy  # type: ignore[assignment]
    try:
        a.write(peer, Blocks(seg, remote, lo, ro, 4096)).wait(10)
        for k in range(3):
            assert np.array_equal(dst[ro[k]:ro[k] + 4096], src[lo[k]:lo[k] + 4096])
        a.write(peer, Blocks(seg, remote, lo, ro + 1, [4096, 100, 5])).wait(10)
    finally:
        tcp.encode_request = encode  # type: ignore[assignment]
    assert seen == [FLAG_UNIFORM, 0]
    for k, n in enumerate([4096, 100, 5]):
        assert np.array_equal(dst[ro[k] + 1:ro[k] + 1 + n], src[lo[k]:lo[k] + n])
