"""A put whose writer stalls past its deadline: the master gives its space to another
object only once the nodes have fenced that writer off their engines
(``Engine.cut_peer``), and the writer starts no write past its own deadline, so a late
WRITE never lands in another object's bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import StoreError
from kvstore.master import Master
from kvstore.node import StorageNode

MiB = 1 << 20


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stall", ["after_connect", "before_connect"])
def test_a_stalled_writer_never_lands_in_space_given_to_another(stall: str) -> None:
    """The node holds one value. A client stalls in its put (after connecting to the
    node, or before), past the put's deadline; the space goes to another client's
    value; then the stalled client goes on. Its write must not land: the node cut it
    off (after_connect), or it sees that its time to write has passed (before_connect)."""
    size = 4 * MiB
    rng = np.random.default_rng(11)
    old = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    new = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    with Master(put_timeout_s=0.5, lease_s=1.0, node_interval=0.1) as master, \
            StorageNode(master.endpoint, size, name="n0") as node:
        master.wait_nodes(1)
        with Client(master.endpoint, name="late", timeout=20) as late, \
                Client(master.endpoint, name="fresh", timeout=20) as fresh:
            gate, reached = threading.Event(), threading.Event()
            target: Any = late.engine if stall == "after_connect" else late
            attr = "write" if stall == "after_connect" else "_peer"
            real = getattr(target, attr)

            def stalled(*args: Any, **kwargs: Any) -> Any:
                reached.set()
                gate.wait(30)
                return real(*args, **kwargs)

            setattr(target, attr, stalled)
            errors: list[BaseException] = []

            def put_old() -> None:
                try:
                    late.put("old", old)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)

            thread = threading.Thread(target=put_old)
            thread.start()
            try:
                assert reached.wait(10)
                _until(lambda: master.counters["puts_expired"] >= 1)
                fresh.put("new", new)  # the stalled put's space, once the node fenced
                if stall == "after_connect":
                    assert node.fenced >= 1
            finally:
                gate.set()
                thread.join(30)
            assert not thread.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], StoreError), errors
            time.sleep(0.2)
            assert fresh.get("new") == new, "a late WRITE landed in another value's space"
            assert late.get("old") is None
