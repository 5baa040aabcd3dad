"""The pace a peer's message must keep (``iovec.Pace``), over real socket pairs: a
peer that takes a target's READ answer at a trickle is cut as one that sends a
payload at a trickle is (``test_attack_bounds.py``), and one that keeps up gets every
byte."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine.transport.iovec import IOVEC_IO, MIN_PAYLOAD_RATE, Pace, send_iov
from transfer_engine.transport.stream.io import PeerClosed, recv_into_views, send_views

pytestmark = pytest.mark.skipif(not IOVEC_IO, reason="no libc sendmsg on this host")


def _pair(stall: float) -> tuple[socket.socket, socket.socket]:
    """A loopback TCP pair whose buffers hold little (so the reader's pace shows at
    once) and whose sender's blocked calls end after ``stall``, as a target's rails
    do. (A unix socket's send waits ``stall`` per chunk, not per call.)"""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        rx = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        rx.connect(listener.getsockname())
        tx, _ = listener.accept()
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(stall),
                                                                      int(stall % 1 * 1e6)))
    return tx, rx


def _reader(rx: socket.socket, chunk: int, every: float, out: bytearray,
            stop: threading.Event) -> threading.Thread:
    def run() -> None:
        rx.settimeout(0.5)
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                data = rx.recv(chunk)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            out.extend(data)
            time.sleep(every)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _iov(data: np.ndarray) -> np.ndarray:
    return np.array([[data.ctypes.data, data.nbytes]], dtype=np.uint64)


def test_a_reader_slower_than_the_pace_cuts_the_send() -> None:
    """Before, each blocked call needed only some progress within the stall: a reader
    taking 4 KiB every 0.1 s (40 KiB/s) kept an 8 MiB answer going for 200 s."""
    tx, rx = _pair(0.3)
    got = bytearray()
    stop = threading.Event()
    data = random_bytes(8 << 20, 3)
    reader = _reader(rx, 4096, 0.1, got, stop)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="KiB/s"):
            send_iov(tx, _iov(data), data.nbytes, Pace(0.3))
        took = time.monotonic() - started
        assert took < 4, took
        assert len(got) < 1 << 20
    finally:
        stop.set()
        tx.close()
        rx.close()
        reader.join(5)


def test_views_sent_slower_than_the_pace_are_cut_as_peer_closed() -> None:
    """The same through :func:`send_views` (a serving process's READ through its
    bounce): the target's worker sees the rail's end, not a hang."""
    tx, rx = _pair(0.3)
    got = bytearray()
    stop = threading.Event()
    data = random_bytes(8 << 20, 4)
    reader = _reader(rx, 4096, 0.1, got, stop)
    try:
        with pytest.raises(PeerClosed, match="KiB/s"):
            send_views(tx, [memoryview(data.data)], data.nbytes, Pace(0.3))
    finally:
        stop.set()
        tx.close()
        rx.close()
        reader.join(5)


def test_a_reader_that_keeps_up_gets_every_byte_in_order() -> None:
    """A reader well above the pace, pausing between reads, is never cut."""
    tx, rx = _pair(0.3)
    got = bytearray()
    stop = threading.Event()
    data = random_bytes(2 << 20, 5)
    reader = _reader(rx, 64 << 10, 0.01, got, stop)
    try:
        send_iov(tx, _iov(data), data.nbytes, Pace(0.3))
        deadline = time.monotonic() + 10
        while len(got) < data.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bytes(got) == data.tobytes()
    finally:
        stop.set()
        tx.close()
        rx.close()
        reader.join(5)


def test_a_pace_allows_one_stall_and_counts_every_call() -> None:
    """Behind means: past one stall, fewer bytes than the time since at the minimum
    rate. One pace spans the calls of one message (a bounce refilled, chunks)."""
    pace = Pace(0.2)
    assert not pace.behind()
    time.sleep(0.25)
    assert pace.behind()  # a stall and more, nothing came
    pace.got += MIN_PAYLOAD_RATE  # a second's worth: ahead again
    assert not pace.behind()
    with pytest.raises(TimeoutError):
        Pace(-1.0).check(10)


def test_a_trickled_receive_is_cut_and_a_prompt_one_is_not() -> None:
    """The receiving side, through :func:`recv_into_views`: bytes a few at a time
    within every stall are cut after about two stalls."""
    tx, rx = socket.socketpair()
    rx.settimeout(0.3)
    buf = bytearray(1 << 20)
    stop = threading.Event()

    def trickle() -> None:
        for _ in range(300):
            if stop.is_set():
                return
            try:
                tx.send(b"\x07" * 16)
            except OSError:
                return
            time.sleep(0.05)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerClosed, match="KiB/s"):
            recv_into_views(rx, [memoryview(buf)], len(buf), pace=Pace(0.3))
        assert time.monotonic() - started < 3
    finally:
        stop.set()
        sender.join(5)
        tx.close()
        rx.close()
