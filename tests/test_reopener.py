"""The background reopening of broken NIC rails (``tcp_nics.Reopener``), with plain
callables for the rails: tries again while the peer is in use, hands the new rail over
once, gives up when the peer is gone or after its tries, and stops on close."""

from __future__ import annotations

import threading
import time

import pytest

from transfer_engine.transport.reopen import Reopener


def _wait(cond: threading.Event, timeout: float = 5.0) -> None:
    assert cond.wait(timeout), "timed out"


def test_a_path_that_comes_back_is_handed_over_once() -> None:
    reopener: Reopener[str] = Reopener("t", retry=0.02)
    tries: list[float] = []
    done = threading.Event()

    def open_again() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise OSError("link down")
        done.set()
        return "new-rail"

    try:
        reopener.schedule("old", open_again, lambda: True)
        reopener.schedule("old", open_again, lambda: True)  # once per broken rail
        _wait(done)
        for _ in range(100):
            got = reopener.revived("old")
            if got is not None:
                break
            time.sleep(0.01)
        assert got == "new-rail" and len(tries) == 3 and reopener.reopened == 1
        assert reopener.revived("old") is None
    finally:
        reopener.close()


def test_it_gives_up_when_the_peer_is_gone_or_after_its_tries() -> None:
    reopener: Reopener[str] = Reopener("t", retry=0.01, max_tries=3)
    calls = {"gone": 0, "stubborn": 0}
    alive = {"gone": True}

    def fail(key: str) -> str:
        calls[key] += 1
        alive["gone"] = False  # the peer went away after the first try
        raise OSError("down")

    try:
        reopener.schedule("gone", lambda: fail("gone"), lambda: alive["gone"])
        reopener.schedule("stubborn", lambda: fail("stubborn"), lambda: True)
        time.sleep(0.5)
        assert calls == {"gone": 1, "stubborn": 3}
        assert reopener.revived("gone") is None and reopener.revived("stubborn") is None
    finally:
        reopener.close()


def test_close_stops_it_and_bad_settings_are_refused() -> None:
    reopener: Reopener[str] = Reopener("t", retry=10.0)
    reopener.schedule("x", lambda: "rail", lambda: True)
    started = time.monotonic()
    reopener.close()
    assert time.monotonic() - started < 2.0
    reopener.schedule("y", lambda: "rail", lambda: True)  # after close: nothing
    assert reopener.revived("x") is None and reopener.revived("y") is None
    with pytest.raises(ValueError, match="retry"):
        Reopener("t", retry=0)


def test_soon_tries_at_once_even_a_path_already_waiting() -> None:
    reopener: Reopener[str] = Reopener("t", retry=30.0)
    opened = threading.Event()

    def open_again() -> str:
        opened.set()
        return "new"

    try:
        reopener.schedule("old", open_again, lambda: True)  # next try in 30 s
        assert not opened.wait(0.2)
        reopener.schedule("old", open_again, lambda: True, soon=True)
        _wait(opened, 2.0)
    finally:
        reopener.close()
