"""Transfer handles: every waiter wakes once the transfer finishes, with its outcome."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.faults import finish_as_engine
from transfer_engine import PeerLostError, TransferState, TransferTimeout
from transfer_engine.descriptor import Op
from transfer_engine.handle import TransferHandle


def test_wait_times_out_while_pending_then_returns_for_every_waiter() -> None:
    h = TransferHandle(1, Op.WRITE, "b", 10)
    with pytest.raises(TransferTimeout) as info:
        h.wait(0)
    assert info.value.peer == "b" and info.value.length == 10
    with pytest.raises(TransferTimeout):
        h.wait(0.01)
    woke: list[float] = []
    threads = [threading.Thread(target=lambda: (h.wait(10), woke.append(time.monotonic())))
               for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert not woke and not h.done()
    assert finish_as_engine(h) and not finish_as_engine(h)  # once only
    for t in threads:
        t.join(10)
    assert len(woke) == 4 and h.state is TransferState.DONE
    h.wait(0)
    h.wait()


def test_every_waiter_sees_the_error() -> None:
    h = TransferHandle(2, Op.READ, "b", 10)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            h.wait(10)
        except PeerLostError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    finish_as_engine(h, PeerLostError("gone", peer="b"))
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and h.state is TransferState.FAILED
    with pytest.raises(PeerLostError):
        h.wait(0)


def test_done_callbacks_run_once_with_the_outcome(caplog: pytest.LogCaptureFixture) -> None:
    h = TransferHandle(3, Op.WRITE, "b", 10)
    seen: list[tuple[str, TransferState]] = []

    def boom(_: TransferHandle) -> None:
        raise RuntimeError("callback bug")

    h.add_done_callback(lambda x: seen.append(("first", x.state)))
    h.add_done_callback(boom)  # logged; the others still run
    h.add_done_callback(lambda x: seen.append(("second", x.state)))
    assert not seen
    with caplog.at_level("ERROR", logger="transfer_engine.handle"):
        assert finish_as_engine(h, PeerLostError("gone", peer="b"))
    assert seen == [("first", TransferState.FAILED), ("second", TransferState.FAILED)]
    assert "callback bug" in caplog.text
    assert not finish_as_engine(h)
    h.add_done_callback(lambda x: seen.append(("late", x.state)))  # finished: at once
    assert seen[-1] == ("late", TransferState.FAILED) and len(seen) == 3
    with pytest.raises(PeerLostError):
        h.wait(0)


def test_a_done_callback_added_while_the_transfer_finishes_runs_exactly_once() -> None:
    for i in range(200):
        h = TransferHandle(100 + i, Op.READ, "b", 1)
        calls: list[TransferHandle] = []
        t = threading.Thread(target=finish_as_engine, args=(h,))
        t.start()
        h.add_done_callback(calls.append)
        t.join(10)
        assert calls == [h] and h.state is TransferState.DONE
